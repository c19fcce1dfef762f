"""The standard gRPC health protocol (grpc.health.v1) as every pdserve service speaks it.

    service       where                   health service names
    scheduler     its own gRPC port       "" SERVING while a request can be served (a decode
                                          worker is attached; see Workers.can_serve),
                                          "pdserve.prefill" while a prefill worker can hand KV
                                          to a decode worker, "pdserve.decode" while a decode
                                          worker is attached, "pdserve.scheduler.Scheduler"
                                          while the process serves its API (liveness)
    worker        --health-port           "" SERVING while attached to the scheduler
    gateway       HTTP                    /health liveness; /ready follows the scheduler's ""

Every status turns NOT_SERVING for good when its process begins to stop. `pdserve health
ADDRESS [--service NAME]` is the probe, like grpc_health_probe: exit 0 for SERVING only.
"""
from __future__ import annotations

import grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_options import server_options

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def status_name(status: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


class Health:
    """The health service of one gRPC server; statuses change only through `set`."""

    def __init__(self, server: grpc.aio.Server) -> None:
        # it starts with "" SERVING: a server whose "" means more sets it at once
        self.servicer = grpc_health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        self._serving: dict[str, bool] = {}
        self._own_server: grpc.aio.Server | None = None

    @classmethod
    async def serve(cls, host: str, port: int) -> tuple[Health, int]:
        """A gRPC server of its own with nothing but the health service, "" NOT_SERVING;
        returns the Health (stop() stops the server too) and the bound port."""
        server = grpc.aio.server(options=server_options())
        health = cls(server)
        health._own_server = server
        await health.set("", False)
        bound = server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot bind the health port {host}:{port}")
        await server.start()
        return health, bound

    async def also_serve(self, host: str, port: int) -> int:
        """The same statuses on a server of their own, in the clear, beside a server that takes
        mutual TLS (probes that present no certificate); returns the bound port."""
        server = grpc.aio.server(options=server_options())
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        bound = server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot bind the health port {host}:{port}")
        await server.start()
        self._own_server = server
        return bound

    async def set(self, service: str, serving: bool) -> None:
        if self._serving.get(service) != serving:
            self._serving[service] = serving
            await self.servicer.set(service, SERVING if serving else NOT_SERVING)

    async def stop(self) -> None:
        """Every service NOT_SERVING from now on, whatever set() is called later; a server of
        its own stops."""
        await self.servicer.enter_graceful_shutdown()
        if self._own_server is not None:
            await self._own_server.stop(grace=None)


def check(target: str | grpc.Channel, service: str = "", timeout_s: float = 5.0) -> str:
    """The service's status name (SERVING, NOT_SERVING, ...) at an address (in the clear) or over
    a channel; raises grpc.RpcError when the server cannot be reached or does not know the
    service (NOT_FOUND)."""
    if isinstance(target, str):
        with grpc.insecure_channel(target) as channel:
            return check(channel, service, timeout_s)
    response = health_pb2_grpc.HealthStub(target).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return status_name(response.status)
