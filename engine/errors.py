"""Errors the engine raises: bad input (the service maps it onto gRPC INVALID_ARGUMENT) and a broken model group."""


class InvalidRequest(ValueError):
    """A request value the engine cannot serve; `field` names the offending field (e.g. ``temperature``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.description = message


class ModelGroupBroken(RuntimeError):
    """A model spread over processes (tensor-parallel ranks, pipeline nodes) lost one: the group cannot run another
    step and must be restarted whole. The service maps it onto gRPC UNAVAILABLE (another replica can serve the call);
    an engine's own step failure stays INTERNAL."""
