"""Server reflection under both names clients ask for: `grpc.reflection.v1` and `grpc.reflection.v1alpha`.

grpcio-reflection (1.85) serves only v1alpha. Newer clients (grpcurl >= 1.9, `buf curl`, grpcui, grpc-java's
tools) ask v1 first and fall back on UNIMPLEMENTED; a client without the fallback cannot use the server at all. The
two protocols are the same proto under another package name (every message and field number equal), so the
v1alpha servicer answers v1 calls byte for byte; only the v1 descriptor is added to the pool, so that a client
describing `grpc.reflection.v1.ServerReflection` finds it.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _register_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Add the v1 reflection proto (v1alpha's, renamed) to `pool` once."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = _V1_FILE
    proto.package = "grpc.reflection.v1"
    prefix = ".grpc.reflection.v1alpha."
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(prefix):
                field.type_name = ".grpc.reflection.v1." + field.type_name[len(prefix) :]
    for service in proto.service:
        for method in service.method:
            method.input_type = ".grpc.reflection.v1." + method.input_type[len(prefix) :]
            method.output_type = ".grpc.reflection.v1." + method.output_type[len(prefix) :]
    pool.Add(proto)


def enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection for `service_names` (plus both reflection services) as v1 and v1alpha."""
    pool = descriptor_pool.Default()
    _register_v1_descriptor(pool)
    servicer = reflection.aio.ReflectionServicer([*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME], pool=pool)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    for name in (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME):
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}),)
        )
