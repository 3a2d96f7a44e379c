"""How memtopo's gRPC servers are made, the agent's and the controller's alike: one message limit,
grpc.health.v1 and server reflection on every server (grpc itself is imported when a server is made,
so the limit can be read without it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc
    from grpc_health.v1 import health

# A 64-node host's topology is a few hundred KiB; leave room for large accelerator fleets.
MAX_MESSAGE_BYTES = 64 << 20
MESSAGE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)


def grpc_server(services: Sequence[str], health_servicer: health.aio.HealthServicer, *,
                options: Sequence[tuple[str, Any]] = (), interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                receive_limit: bool = True) -> grpc.aio.Server:
    """A grpc.aio server with the message limit, the health service and reflection of ``services``
    (full names) beside health and reflection themselves; the caller adds its own handlers.
    ``receive_limit`` False leaves grpc's own 4 MiB cap on what clients send (the agent's requests are
    small; its answers are the big messages)."""
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc  # type: ignore[import-untyped, unused-ignore]
    from grpc_reflection.v1alpha import reflection  # type: ignore[import-untyped, unused-ignore]

    limits = MESSAGE_OPTIONS if receive_limit else MESSAGE_OPTIONS[1:]
    server = grpc.aio.server(interceptors=list(interceptors), options=[*limits, *options])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server
