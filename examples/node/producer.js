// A Node.js producer for mailroom: @grpc/grpc-js with the protos loaded from proto/ at
// run time by @grpc/proto-loader (no code generation); enqueues with an idempotency key
// and retries the way mailroom's errors ask.
//
// - Every error carries google.rpc.ErrorInfo with a stable `reason` (domain
//   "mailroom.v1") in the `grpc-status-details-bin` trailer: branch on it, never on the
//   message text.
// - RESOURCE_EXHAUSTED from load and UNAVAILABLE carry google.rpc.RetryInfo: wait that
//   long, then retry with the same idempotency key (a retry of a stored event answers
//   `duplicate: true` with the same id, so retrying is always safe).
// - INVALID_ARGUMENT carries google.rpc.BadRequest naming the offending fields.
//
// usage: node producer.js HOST:PORT PROTO_DIR
//   MAILROOM_CA     the server's CA certificate (PEM); TLS when set, plaintext otherwise
//   MAILROOM_TOKEN  the bearer token (the shipped deployment requires TLS and a token)
// Prints one JSON line: the enqueued id (an int64, as a string: JSON numbers lose
// precision past 2^53) and what the server said about a bad event.
"use strict";

const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");

const RETRYABLE = new Set([grpc.status.RESOURCE_EXHAUSTED, grpc.status.UNAVAILABLE]);

// The parts of googleapis' google/rpc/status.proto and error_details.proto that mailroom
// sends, for decoding `grpc-status-details-bin` (field numbers as upstream).
const rpcTypes = new protobuf.Root();
protobuf.parse(
  `syntax = "proto3";
   package google.protobuf;
   message Any { string type_url = 1; bytes value = 2; }
   message Duration { int64 seconds = 1; int32 nanos = 2; }`,
  rpcTypes,
  { keepCase: true },
);
protobuf.parse(
  `syntax = "proto3";
   package google.rpc;
   message Status { int32 code = 1; string message = 2; repeated google.protobuf.Any details = 3; }
   message ErrorInfo { string reason = 1; string domain = 2; map<string, string> metadata = 3; }
   message RetryInfo { google.protobuf.Duration retry_delay = 1; }
   message BadRequest {
     message FieldViolation { string field = 1; string description = 2; string reason = 3; }
     repeated FieldViolation field_violations = 1;
   }`,
  rpcTypes,
  { keepCase: true },
);
const Status = rpcTypes.lookupType("google.rpc.Status");
const DETAILS = {
  "type.googleapis.com/google.rpc.ErrorInfo": ["error_info", rpcTypes.lookupType("google.rpc.ErrorInfo")],
  "type.googleapis.com/google.rpc.RetryInfo": ["retry_info", rpcTypes.lookupType("google.rpc.RetryInfo")],
  "type.googleapis.com/google.rpc.BadRequest": ["bad_request", rpcTypes.lookupType("google.rpc.BadRequest")],
};

/** ErrorInfo, RetryInfo and BadRequest of a failed call, as an object. */
function details(error) {
  const found = {};
  const [bin] = error.metadata ? error.metadata.get("grpc-status-details-bin") : [];
  if (!bin) return found;
  const status = Status.toObject(Status.decode(bin), { longs: Number });
  for (const any of status.details || []) {
    const known = DETAILS[any.type_url];
    if (known) {
      const [name, type] = known;
      found[name] = type.toObject(type.decode(any.value), { longs: Number, defaults: true });
    }
  }
  return found;
}

/** One unary call as a promise, with a deadline. */
/** The bearer token on every call, when MAILROOM_TOKEN names one. */
function auth() {
  const md = new grpc.Metadata();
  if (process.env.MAILROOM_TOKEN) md.add("authorization", `Bearer ${process.env.MAILROOM_TOKEN}`);
  return md;
}

function call(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, auth(), { deadline: Date.now() + 10_000 }, (err, response) =>
      err ? reject(err) : resolve(response),
    );
  });
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Enqueue, retrying RESOURCE_EXHAUSTED/UNAVAILABLE after the server's RetryInfo delay. */
async function enqueue(client, event, attempts = 8) {
  for (let attempt = 0; ; attempt++) {
    try {
      return await call(client, "Enqueue", { event });
    } catch (err) {
      if (!RETRYABLE.has(err.code) || attempt === attempts - 1) throw err;
      const d = details(err);
      const reason = d.error_info ? d.error_info.reason : "?";
      let delayMs = 200 * 2 ** attempt;
      if (d.retry_info && d.retry_info.retry_delay) {
        const { seconds, nanos } = d.retry_info.retry_delay;
        delayMs = seconds * 1000 + nanos / 1e6;
      }
      console.error(`retrying after ${reason}: waiting ${(delayMs / 1000).toFixed(2)}s`);
      await sleep(delayMs);
    }
  }
}

async function main() {
  const [addr, protoDir] = process.argv.slice(2);
  if (!addr || !protoDir) {
    console.error("usage: node producer.js HOST:PORT PROTO_DIR");
    process.exit(64);
  }
  const definition = protoLoader.loadSync("mailroom/v1/outbox.proto", {
    includeDirs: [protoDir],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
  });
  const { mailroom } = grpc.loadPackageDefinition(definition);
  const ca = process.env.MAILROOM_CA;
  const creds = ca
    ? grpc.credentials.createSsl(require("fs").readFileSync(ca))
    : grpc.credentials.createInsecure();
  const client = new mailroom.v1.OutboxService(addr, creds);

  const event = {
    topic: "examples.orders",
    key: "order-42",
    payload: Buffer.from(JSON.stringify({ total: 10 })),
    headers: { "content-type": "application/json" },
    type: "order.created",
    idempotency_key: "checkout-req-node-3c8a",
  };
  const stored = await enqueue(client, event);
  const again = await enqueue(client, event);
  if (again.id !== stored.id || !again.duplicate) {
    throw new Error(`a retry was not a duplicate: ${JSON.stringify({ stored, again })}`);
  }

  // A mistake the caller can act on: the reason and the field say what is wrong.
  let invalid;
  try {
    await enqueue(client, { topic: "not a topic" });
    throw new Error("an invalid topic was accepted");
  } catch (err) {
    if (err.code === undefined) throw err;
    const d = details(err);
    invalid = {
      code: grpc.status[err.code],
      reason: d.error_info.reason,
      domain: d.error_info.domain,
      fields: d.bad_request.field_violations.map((v) => v.field),
    };
  }
  client.close();
  console.log(JSON.stringify({ id: stored.id, duplicate_id: again.id, invalid }));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
