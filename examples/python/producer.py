"""A Python producer for mailroom: stubs generated from proto/ at run time with
grpcio-tools; enqueues with an idempotency key and retries the way mailroom's errors ask.

- Every error carries google.rpc.ErrorInfo with a stable `reason` (domain
  "mailroom.v1"): branch on it, never on the message text.
- RESOURCE_EXHAUSTED from load and UNAVAILABLE carry google.rpc.RetryInfo: wait that
  long, then retry with the same idempotency key (a retry of a stored event answers
  `duplicate: true` with the same id, so retrying is always safe).
- INVALID_ARGUMENT carries google.rpc.BadRequest naming the offending fields.

usage: producer.py HOST:PORT PROTO_DIR
  MAILROOM_CA     the server's CA certificate (PEM); TLS when set, plaintext otherwise
  MAILROOM_TOKEN  the bearer token (the shipped deployment requires TLS and a token)
Prints one JSON line: the enqueued id and what the server said about a bad event.
Needs: grpcio, grpcio-tools, grpcio-status.
"""
import importlib
import json
import os
import sys
import tempfile
import time

import grpc
import grpc_tools
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from grpc_tools import protoc

RETRYABLE = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}
TOKEN = os.environ.get("MAILROOM_TOKEN")
AUTH = [("authorization", f"Bearer {TOKEN}")] if TOKEN else []


def channel(addr: str) -> grpc.Channel:
    """TLS with the CA in MAILROOM_CA, else plaintext (a local development server)."""
    ca = os.environ.get("MAILROOM_CA")
    if ca:
        with open(ca, "rb") as f:
            return grpc.secure_channel(addr, grpc.ssl_channel_credentials(root_certificates=f.read()))
    return grpc.insecure_channel(addr)


def generate(proto_dir: str) -> None:
    out = tempfile.mkdtemp(prefix="mailroom_py_producer_")
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    rc = protoc.main([
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        "mailroom/v1/outbox.proto",
    ])
    if rc != 0:
        sys.exit(f"protoc failed: {rc}")
    sys.path.insert(0, out)


def details(error: grpc.RpcError) -> dict:
    """ErrorInfo, RetryInfo and BadRequest of a failed call, as a dict."""
    found = {}
    status = rpc_status.from_call(error)
    for any_detail in status.details if status else []:
        for name, cls in [
            ("error_info", error_details_pb2.ErrorInfo),
            ("retry_info", error_details_pb2.RetryInfo),
            ("bad_request", error_details_pb2.BadRequest),
        ]:
            if any_detail.Is(cls.DESCRIPTOR):
                msg = cls()
                any_detail.Unpack(msg)
                found[name] = msg
    return found


def enqueue(stub, pb, event, attempts: int = 8):
    """Enqueue, retrying RESOURCE_EXHAUSTED/UNAVAILABLE after the server's RetryInfo delay."""
    for attempt in range(attempts):
        try:
            return stub.Enqueue(pb.EnqueueRequest(event=event), timeout=10, metadata=AUTH)
        except grpc.RpcError as e:
            if e.code() not in RETRYABLE or attempt == attempts - 1:
                raise
            d = details(e)
            reason = d["error_info"].reason if "error_info" in d else "?"
            delay = 0.2 * 2 ** attempt
            if "retry_info" in d:
                delay = d["retry_info"].retry_delay.ToTimedelta().total_seconds()
            print(f"retrying after {reason}: waiting {delay:.2f}s", file=sys.stderr)
            time.sleep(delay)


def main() -> None:
    addr, proto_dir = sys.argv[1], sys.argv[2]
    generate(proto_dir)
    pb = importlib.import_module("mailroom.v1.outbox_pb2")
    rpc = importlib.import_module("mailroom.v1.outbox_pb2_grpc")
    stub = rpc.OutboxServiceStub(channel(addr))

    event = pb.Event(
        topic="examples.orders",
        key="order-42",
        payload=json.dumps({"total": 10}).encode(),
        headers={"content-type": "application/json"},
        type="order.created",
        idempotency_key="checkout-req-9f1c",
    )
    stored = enqueue(stub, pb, event)
    again = enqueue(stub, pb, event)
    assert again.id == stored.id and again.duplicate, (stored, again)

    # A mistake the caller can act on: the reason and the field say what is wrong.
    try:
        enqueue(stub, pb, pb.Event(topic="not a topic"))
        sys.exit("an invalid topic was accepted")
    except grpc.RpcError as e:
        d = details(e)
        bad = {
            "code": e.code().name,
            "reason": d["error_info"].reason,
            "domain": d["error_info"].domain,
            "fields": [v.field for v in d["bad_request"].field_violations],
        }
    print(json.dumps({"id": stored.id, "invalid": bad}))


if __name__ == "__main__":
    main()
