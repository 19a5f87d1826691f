"""A Python subscriber: implements mailroom.v1.HandlerService with grpcio, stubs
generated from proto/ at run time. Appends each request as a JSON line to LOG_FILE;
answers reject for the payload "reject", success otherwise.

usage: handler.py PORT PROTO_DIR LOG_FILE
"""
import importlib
import json
import os
import sys
import tempfile
from concurrent import futures

import grpc
import grpc_tools
from grpc_tools import protoc


def generate(proto_dir: str) -> None:
    out = tempfile.mkdtemp(prefix="mailroom_py_handler_")
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    rc = protoc.main([
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        "mailroom/v1/handler.proto",
    ])
    if rc != 0:
        sys.exit(f"protoc failed: {rc}")
    sys.path.insert(0, out)


def main() -> None:
    port, proto_dir, log_file = sys.argv[1], sys.argv[2], sys.argv[3]
    generate(proto_dir)
    pb = importlib.import_module("mailroom.v1.handler_pb2")
    rpc = importlib.import_module("mailroom.v1.handler_pb2_grpc")

    class Handler(rpc.HandlerServiceServicer):
        def Handle(self, request, context):
            with open(log_file, "a", encoding="utf-8") as f:
                f.write(json.dumps({
                    "message_id": request.message_id,
                    "subscription": request.subscription,
                    "key": request.key,
                    "payload": request.payload.decode("utf-8", "replace"),
                    "attempt": request.attempt,
                }) + "\n")
            if request.payload == b"reject":
                return pb.HandleResponse(reject=pb.HandleReject(reason="python says no"))
            return pb.HandleResponse(success=pb.HandleSuccess())

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    rpc.add_HandlerServiceServicer_to_server(Handler(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    main()
