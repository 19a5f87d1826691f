"""A dynamic client with no stubs: Python's grpcio-reflection (which speaks only
grpc.reflection.v1alpha) lists mailroom's services, resolves OutboxService.Enqueue's
message types from the server and calls it. Prints one JSON line.

Usage: reflection_client.py HOST:PORT
"""
import json
import sys

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)


def main() -> None:
    channel = grpc.insecure_channel(sys.argv[1])
    db = ProtoReflectionDescriptorDatabase(channel)
    services = sorted(db.get_services())
    pool = DescriptorPool(db)
    method = pool.FindServiceByName("mailroom.v1.OutboxService").FindMethodByName("Enqueue")
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    request = request_class()
    request.event.topic = "reflected"
    request.event.key = "py-reflection"
    request.event.payload = b"found by reflection"
    enqueue = channel.unary_unary(
        "/mailroom.v1.OutboxService/Enqueue",
        request_serializer=request_class.SerializeToString,
        response_deserializer=response_class.FromString,
    )
    response = enqueue(request, timeout=10)
    print(json.dumps({"services": services, "id": response.id}))


if __name__ == "__main__":
    main()
