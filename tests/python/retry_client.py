"""gRPC's built-in retries with mailroom's service config (docs/grpc-service-config.json):
against a server that admits one RPC at a time, eight concurrent EnqueueBatch calls are refused
with RESOURCE_EXHAUSTED and a pushback; without the config some calls fail, with it every
call succeeds after the server's pushback. Prints one JSON line; exits non-zero otherwise.

usage: retry_client.py HOST:PORT PROTO_DIR SERVICE_CONFIG
"""
import importlib
import json
import sys

import grpc

from outbox_client import generate


CALLS = 8


def burst(channel, pb, rpc, label):
    stub = rpc.OutboxServiceStub(channel)
    calls = []
    for c in range(CALLS):
        events = [pb.Event(topic="py.retry", key=f"{label}-{c}-{i}", payload=b"r" * 512) for i in range(100)]
        calls.append(stub.EnqueueBatch.future(pb.EnqueueBatchRequest(events=events), timeout=30))
    ok, refused = 0, []
    for f in calls:
        try:
            f.result()
            ok += 1
        except grpc.RpcError as e:
            refused.append(e.code().name)
    return ok, refused


def main() -> None:
    addr, proto_dir, config_path = sys.argv[1], sys.argv[2], sys.argv[3]
    generate(proto_dir)
    pb = importlib.import_module("mailroom.v1.outbox_pb2")
    rpc = importlib.import_module("mailroom.v1.outbox_pb2_grpc")
    config = open(config_path).read()
    json.loads(config)
    plain_ok, plain_refused = burst(grpc.insecure_channel(addr, options=[("grpc.enable_retries", 0)]), pb, rpc, "plain")
    with_config = grpc.insecure_channel(addr, options=[("grpc.service_config", config), ("grpc.enable_retries", 1)])
    retried_ok, retried_refused = burst(with_config, pb, rpc, "retried")
    print(json.dumps({
        "plain_ok": plain_ok, "plain_refused": plain_refused,
        "retried_ok": retried_ok, "retried_refused": retried_refused,
    }))


if __name__ == "__main__":
    main()
