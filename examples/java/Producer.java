// A Java producer for mailroom: grpc-java (Netty) with the stubs scripts/gen-stubs.sh
// generates (gen/java, package dev.mailroom.v1), connecting as the shipped deployment
// requires: TLS and a bearer token.
//
// It enqueues with an idempotency key (a retry answers duplicate with the same id),
// retries RESOURCE_EXHAUSTED and UNAVAILABLE after the server's RetryInfo delay, and
// reads the ErrorInfo reason and BadRequest fields of a refused event from the
// grpc-status-details-bin trailer (a google.rpc.Status, read field by field, so that
// no googleapis jar is needed).
//
// usage: java Producer HOST:PORT
//   MAILROOM_CA     the server's CA certificate (PEM); TLS when set, plaintext otherwise
//   MAILROOM_TOKEN  the bearer token (a token with the enqueue scope)
// Prints one JSON line: the id, whether the retry was a duplicate, and the refusal.

import com.google.protobuf.ByteString;
import com.google.protobuf.UnknownFieldSet;
import dev.mailroom.v1.EnqueueRequest;
import dev.mailroom.v1.EnqueueResponse;
import dev.mailroom.v1.Event;
import dev.mailroom.v1.OutboxServiceGrpc;
import io.grpc.ManagedChannel;
import io.grpc.Metadata;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.netty.GrpcSslContexts;
import io.grpc.netty.NettyChannelBuilder;
import io.grpc.stub.MetadataUtils;
import java.io.File;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;

public final class Producer {
  private static final Metadata.Key<byte[]> DETAILS =
      Metadata.Key.of("grpc-status-details-bin", Metadata.BINARY_BYTE_MARSHALLER);

  /** What a refusal's google.rpc.Status details say. */
  static final class Details {
    String reason = "";
    String domain = "";
    long retryMillis = -1;
    final List<String> fields = new ArrayList<>();
  }

  static Details details(StatusRuntimeException e) throws Exception {
    Details d = new Details();
    Metadata trailers = e.getTrailers();
    byte[] raw = trailers == null ? null : trailers.get(DETAILS);
    if (raw == null) {
      return d;
    }
    // google.rpc.Status: 3 = repeated Any details (1 = type_url, 2 = value).
    for (ByteString any : UnknownFieldSet.parseFrom(raw).getField(3).getLengthDelimitedList()) {
      UnknownFieldSet a = UnknownFieldSet.parseFrom(any);
      String type = a.getField(1).getLengthDelimitedList().get(0).toStringUtf8();
      UnknownFieldSet v = UnknownFieldSet.parseFrom(a.getField(2).getLengthDelimitedList().get(0));
      if (type.endsWith("/google.rpc.ErrorInfo")) {
        d.reason = first(v, 1);
        d.domain = first(v, 2);
      } else if (type.endsWith("/google.rpc.RetryInfo")) {
        // retry_delay: a google.protobuf.Duration (1 = seconds, 2 = nanos).
        UnknownFieldSet delay = UnknownFieldSet.parseFrom(v.getField(1).getLengthDelimitedList().get(0));
        long s = delay.getField(1).getVarintList().isEmpty() ? 0 : delay.getField(1).getVarintList().get(0);
        long n = delay.getField(2).getVarintList().isEmpty() ? 0 : delay.getField(2).getVarintList().get(0);
        d.retryMillis = s * 1000 + n / 1_000_000;
      } else if (type.endsWith("/google.rpc.BadRequest")) {
        for (ByteString fv : v.getField(1).getLengthDelimitedList()) {
          d.fields.add(first(UnknownFieldSet.parseFrom(fv), 1));
        }
      }
    }
    return d;
  }

  static String first(UnknownFieldSet m, int field) {
    List<ByteString> l = m.getField(field).getLengthDelimitedList();
    return l.isEmpty() ? "" : l.get(0).toStringUtf8();
  }

  /** Enqueue, retrying RESOURCE_EXHAUSTED and UNAVAILABLE after the RetryInfo delay. */
  static EnqueueResponse enqueue(OutboxServiceGrpc.OutboxServiceBlockingStub stub, Event e)
      throws Exception {
    for (int attempt = 0; ; attempt++) {
      try {
        return stub.withDeadlineAfter(10, TimeUnit.SECONDS)
            .enqueue(EnqueueRequest.newBuilder().setEvent(e).build());
      } catch (StatusRuntimeException ex) {
        Status.Code code = ex.getStatus().getCode();
        boolean retryable = code == Status.Code.RESOURCE_EXHAUSTED || code == Status.Code.UNAVAILABLE;
        if (!retryable || attempt == 7) {
          throw ex;
        }
        long delay = details(ex).retryMillis;
        delay = delay >= 0 ? delay : 200L << attempt;
        System.err.printf("retrying after %s: waiting %d ms%n", code, delay);
        Thread.sleep(delay);
      }
    }
  }

  static String json(String s) {
    return "\"" + s.replace("\\", "\\\\").replace("\"", "\\\"") + "\"";
  }

  public static void main(String[] args) throws Exception {
    if (args.length != 1) {
      System.err.println("usage: java Producer HOST:PORT");
      System.exit(64);
    }
    NettyChannelBuilder b = NettyChannelBuilder.forTarget(args[0]);
    String ca = System.getenv("MAILROOM_CA");
    if (ca != null && !ca.isEmpty()) {
      b.sslContext(GrpcSslContexts.forClient().trustManager(new File(ca)).build());
    } else {
      b.usePlaintext();
    }
    ManagedChannel channel = b.build();
    Metadata auth = new Metadata();
    String token = System.getenv("MAILROOM_TOKEN");
    if (token != null && !token.isEmpty()) {
      auth.put(Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER), "Bearer " + token);
    }
    OutboxServiceGrpc.OutboxServiceBlockingStub stub =
        OutboxServiceGrpc.newBlockingStub(channel)
            .withInterceptors(MetadataUtils.newAttachHeadersInterceptor(auth));

    Event event = Event.newBuilder()
        .setTopic("examples.orders")
        .setKey("order-42")
        .setPayload(ByteString.copyFrom("{\"total\": 10}", StandardCharsets.UTF_8))
        .putHeaders("content-type", "application/json")
        .setType("order.created")
        .setIdempotencyKey("checkout-req-java-51ab")
        .build();
    EnqueueResponse stored = enqueue(stub, event);
    EnqueueResponse again = enqueue(stub, event);
    if (again.getId() != stored.getId() || !again.getDuplicate()) {
      throw new IllegalStateException("the retry was not answered as a duplicate: " + again);
    }

    // A mistake the caller can act on: the reason and the field say what is wrong.
    String invalid;
    try {
      enqueue(stub, Event.newBuilder().setTopic("not a topic").build());
      throw new IllegalStateException("an invalid topic was accepted");
    } catch (StatusRuntimeException ex) {
      Details d = details(ex);
      List<String> quoted = new ArrayList<>();
      for (String f : d.fields) {
        quoted.add(json(f));
      }
      invalid = "{\"code\":" + json(ex.getStatus().getCode().name()) + ",\"reason\":" + json(d.reason)
          + ",\"domain\":" + json(d.domain) + ",\"fields\":[" + String.join(",", quoted) + "]}";
    }
    System.out.println("{\"id\":" + stored.getId() + ",\"duplicate\":" + again.getDuplicate()
        + ",\"invalid\":" + invalid + "}");
    channel.shutdownNow().awaitTermination(5, TimeUnit.SECONDS);
  }
}
