// A Go producer for mailroom: grpc-go with the stubs scripts/gen-stubs.sh generates
// (gen/go), connecting as the shipped deployment requires: TLS and a bearer token.
//
// It enqueues with an idempotency key (a retry answers duplicate with the same id),
// retries RESOURCE_EXHAUSTED and UNAVAILABLE after the server's RetryInfo delay, and
// reads the ErrorInfo reason and BadRequest fields of a refused event.
//
// usage: producer HOST:PORT
//
//	MAILROOM_CA     the server's CA certificate (PEM); TLS when set, plaintext otherwise
//	MAILROOM_TOKEN  the bearer token (a token with the enqueue scope)
//
// Prints one JSON line: the id, whether the retry was a duplicate, and the refusal.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	mailroomv1 "github.com/mailroom/mailroom/gen/go/mailroom/v1"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// codec encodes messages with google.golang.org/protobuf, as the generated stubs are.
// Debian's grpc-go (1.33) encodes through github.com/golang/protobuf 1.3, which predates
// those stubs; a current grpc-go from the module proxy needs none of this.
type codec struct{}

func (codec) Marshal(v interface{}) ([]byte, error) { return proto.Marshal(v.(proto.Message)) }
func (codec) Unmarshal(b []byte, v interface{}) error {
	return proto.Unmarshal(b, v.(proto.Message))
}
func (codec) Name() string { return "proto" }

func init() { encoding.RegisterCodec(codec{}) }

func dial(addr string) (*grpc.ClientConn, error) {
	if ca := os.Getenv("MAILROOM_CA"); ca != "" {
		creds, err := credentials.NewClientTLSFromFile(ca, "")
		if err != nil {
			return nil, err
		}
		return grpc.Dial(addr, grpc.WithTransportCredentials(creds))
	}
	return grpc.Dial(addr, grpc.WithInsecure())
}

// authed adds the bearer token to a call's metadata.
func authed(ctx context.Context) context.Context {
	if t := os.Getenv("MAILROOM_TOKEN"); t != "" {
		return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+t)
	}
	return ctx
}

// enqueue retries RESOURCE_EXHAUSTED and UNAVAILABLE after the RetryInfo delay.
func enqueue(c mailroomv1.OutboxServiceClient, e *mailroomv1.Event) (*mailroomv1.EnqueueResponse, error) {
	for attempt := 0; ; attempt++ {
		ctx, cancel := context.WithTimeout(authed(context.Background()), 10*time.Second)
		r, err := c.Enqueue(ctx, &mailroomv1.EnqueueRequest{Event: e})
		cancel()
		code := status.Code(err)
		if err == nil || attempt == 7 || (code != codes.ResourceExhausted && code != codes.Unavailable) {
			return r, err
		}
		delay := time.Duration(200<<attempt) * time.Millisecond
		for _, d := range status.Convert(err).Details() {
			if ri, ok := d.(*errdetails.RetryInfo); ok {
				delay = time.Duration(ri.RetryDelay.GetSeconds())*time.Second +
					time.Duration(ri.RetryDelay.GetNanos())
			}
		}
		fmt.Fprintf(os.Stderr, "retrying after %s: waiting %s\n", code, delay)
		time.Sleep(delay)
	}
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: producer HOST:PORT")
		os.Exit(64)
	}
	conn, err := dial(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer conn.Close()
	c := mailroomv1.NewOutboxServiceClient(conn)

	event := &mailroomv1.Event{
		Topic:          "examples.orders",
		Key:            "order-42",
		Payload:        []byte(`{"total": 10}`),
		Headers:        map[string]string{"content-type": "application/json"},
		Type:           "order.created",
		IdempotencyKey: "checkout-req-go-7d2e",
	}
	stored, err := enqueue(c, event)
	if err != nil {
		fmt.Fprintln(os.Stderr, "enqueue:", err)
		os.Exit(1)
	}
	again, err := enqueue(c, event)
	if err != nil || again.Id != stored.Id || !again.Duplicate {
		fmt.Fprintln(os.Stderr, "the retry was not answered as a duplicate:", again, err)
		os.Exit(1)
	}

	// A mistake the caller can act on: the reason and the field say what is wrong.
	_, err = enqueue(c, &mailroomv1.Event{Topic: "not a topic"})
	if err == nil {
		fmt.Fprintln(os.Stderr, "an invalid topic was accepted")
		os.Exit(1)
	}
	invalid := map[string]interface{}{"code": status.Code(err).String()}
	fields := []string{}
	for _, d := range status.Convert(err).Details() {
		switch d := d.(type) {
		case *errdetails.ErrorInfo:
			invalid["reason"], invalid["domain"] = d.Reason, d.Domain
		case *errdetails.BadRequest:
			for _, v := range d.FieldViolations {
				fields = append(fields, v.Field)
			}
		}
	}
	invalid["fields"] = fields
	out, _ := json.Marshal(map[string]interface{}{
		"id": stored.Id, "duplicate": again.Duplicate, "invalid": invalid,
	})
	fmt.Println(string(out))
}
