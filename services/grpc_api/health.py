"""The standard grpc.health.v1 service: grpc_health's asyncio servicer, plus `List`.

`List` (every service's status in one call) was added to health.proto in 2024; grpcio-health-checking's servicer
leaves it to the generated base, which answered UNIMPLEMENTED with "Unexpected <class 'NotImplementedError'>" and
logged a server-side traceback on every call. Here it answers from the statuses this servicer was given.
"""

from __future__ import annotations

from grpc_health.v1 import _async, health_pb2

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthServicer(_async.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self._statuses: dict[str, int] = {"": _SERVING}  # what Check answers, kept here for List
        self._draining = False

    async def set(self, service: str, status: int) -> None:
        if not self._draining:  # as the base: statuses are frozen once graceful shutdown began
            self._statuses[service] = status
        await super().set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        if not self._draining:
            self._statuses = dict.fromkeys(self._statuses, _NOT_SERVING)
            self._draining = True
        await super().enter_graceful_shutdown()

    async def List(self, request: health_pb2.HealthListRequest, context) -> health_pb2.HealthListResponse:  # noqa: N802
        statuses = {name: health_pb2.HealthCheckResponse(status=s) for name, s in self._statuses.items()}
        return health_pb2.HealthListResponse(statuses=statuses)
