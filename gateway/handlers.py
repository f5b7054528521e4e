"""The gRPC method handlers of the Gateway service, with request parsing the servicer answers.

`add_to_server(servicer, server)` registers every method of ``protos/gateway.proto``'s
Gateway service, as the generated ``add_GatewayServicer_to_server`` does, except that a request
whose bytes do not parse reaches the servicer as an `Unparsed` instead of an exception in
gRPC's deserializer (which gRPC answers with INTERNAL "Exception deserializing request!"). The
servicer checks the caller's token first, then refuses it with INVALID_ARGUMENT and
`Unparsed.message`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from protos import gateway_pb2 as gpb

SERVICE = gpb.DESCRIPTOR.services_by_name["Gateway"]


@dataclasses.dataclass(frozen=True)
class Unparsed:
    """Request bytes that do not parse as the method's request type.

    Attributes:
        type_name: the request message's name, e.g. ``PublishRequest``.
        size: how many bytes came (the bytes themselves are never repeated).
    """

    type_name: str
    size: int

    @property
    def message(self) -> str:
        """The refusal, e.g. ``PublishRequest: expected a serialized PublishRequest, got 3
        bytes that do not parse``."""
        return (
            f"{self.type_name}: expected a serialized {self.type_name}, got {self.size} bytes "
            "that do not parse"
        )


def _parser(cls: type[Message]) -> Callable[[bytes], Message | Unparsed]:
    def parse(data: bytes) -> Message | Unparsed:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError):
            return Unparsed(cls.DESCRIPTOR.name, len(data))

    return parse


def add_to_server(servicer: Any, server: grpc.Server) -> None:
    """Register `servicer`'s methods (one per RPC of the Gateway service, named as the RPC)
    on `server`; unparsable requests arrive as `Unparsed`."""
    handlers = {}
    for method in SERVICE.methods:
        request = getattr(gpb, method.input_type.name)
        reply = getattr(gpb, method.output_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=_parser(request),
            response_serializer=reply.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
