"""A Python producer for the polyglot contract: generates stubs from proto/ at run time
with grpcio-tools, enqueues over plain gRPC, checks idempotency, a validation error and
the standard health check. Prints one JSON line with what it saw; exits non-zero on any
mismatch.

usage: outbox_client.py HOST:PORT PROTO_DIR
"""
import importlib
import json
import os
import sys
import tempfile

import grpc
import grpc_tools
from grpc_tools import protoc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def generate(proto_dir: str) -> str:
    out = tempfile.mkdtemp(prefix="mailroom_py_")
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
    return out


def main() -> None:
    addr, proto_dir = sys.argv[1], sys.argv[2]
    generate(proto_dir)
    pb = importlib.import_module("mailroom.v1.outbox_pb2")
    rpc = importlib.import_module("mailroom.v1.outbox_pb2_grpc")
    channel = grpc.insecure_channel(addr)
    stub = rpc.OutboxServiceStub(channel)

    event = pb.Event(
        topic="py.orders",
        key="py-key-1",
        payload=bytes(range(256)),
        headers={"lang": "python", "note": "héllo"},
        type="order.created",
        idempotency_key="py-idem-1",
    )
    first = stub.Enqueue(pb.EnqueueRequest(event=event), timeout=10)
    again = stub.Enqueue(pb.EnqueueRequest(event=event), timeout=10)
    assert again.id == first.id and again.duplicate and not first.duplicate, (first, again)

    try:
        stub.Enqueue(pb.EnqueueRequest(event=pb.Event(topic="bad topic")), timeout=10)
        sys.exit("an invalid topic was accepted")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.code()
        assert "event.topic" in e.details(), e.details()

    batch = stub.EnqueueBatch(
        pb.EnqueueBatchRequest(events=[pb.Event(topic="py.orders", key="py-key-2", payload=b"%d" % i) for i in range(3)]),
        timeout=10,
    )
    ids = [r.id for r in batch.results]
    assert ids == sorted(ids) and len(set(ids)) == 3, ids

    health = health_pb2_grpc.HealthStub(channel)
    overall = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
    outbox = health.Check(health_pb2.HealthCheckRequest(service="mailroom.v1.OutboxService"), timeout=10).status
    assert overall == health_pb2.HealthCheckResponse.SERVING, overall
    assert outbox == health_pb2.HealthCheckResponse.SERVING, outbox

    # With compression on, as many client libraries configure it: gzip on the channel,
    # and per call. The payload compresses well, so the request really travels gzipped.
    gz = grpc.insecure_channel(addr, compression=grpc.Compression.Gzip)
    gz_stub = rpc.OutboxServiceStub(gz)
    gz_event = pb.Event(topic="py.orders", key="py-gzip", payload=b"z" * 100_000, type="order.created")
    gz_id = gz_stub.Enqueue(pb.EnqueueRequest(event=gz_event), timeout=10).id
    gz_batch = gz_stub.EnqueueBatch(
        pb.EnqueueBatchRequest(events=[gz_event, gz_event]), timeout=10, compression=grpc.Compression.Gzip
    )
    assert len(gz_batch.results) == 2, gz_batch
    deflated = gz_stub.Enqueue(pb.EnqueueRequest(event=gz_event), timeout=10, compression=grpc.Compression.Deflate)
    assert deflated.id > gz_id, (deflated, gz_id)
    gz_health = health_pb2_grpc.HealthStub(gz).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
    assert gz_health == health_pb2.HealthCheckResponse.SERVING, gz_health

    print(json.dumps({"id": first.id, "batch_ids": ids, "health": "SERVING", "gzip_id": gz_id}))


if __name__ == "__main__":
    main()
