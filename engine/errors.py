"""Errors the engine raises for bad input. The service maps them onto gRPC INVALID_ARGUMENT."""


class InvalidRequest(ValueError):
    """A request value the engine cannot serve; `field` names the offending field (e.g. ``temperature``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.description = message
