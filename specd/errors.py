"""Errors the engines raise; the gRPC layer maps `code` to a grpc.StatusCode
of the same name. Engines stay free of grpc."""
from __future__ import annotations


class SpecdError(Exception):
    code = "INTERNAL"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(SpecdError):
    code = "INVALID_ARGUMENT"


class FailedPrecondition(SpecdError):
    code = "FAILED_PRECONDITION"


class OutOfRange(SpecdError):
    code = "OUT_OF_RANGE"


class NotFound(SpecdError):
    code = "NOT_FOUND"


class ResourceExhausted(SpecdError):
    code = "RESOURCE_EXHAUSTED"


class Unimplemented(SpecdError):
    code = "UNIMPLEMENTED"


class Unavailable(SpecdError):
    code = "UNAVAILABLE"


class Internal(SpecdError):
    code = "INTERNAL"


class DeadlineExceeded(SpecdError):
    code = "DEADLINE_EXCEEDED"


class Aborted(SpecdError):
    code = "ABORTED"


class WorkerRestarted(Unavailable):
    """The worker answering is another process than the one the router
    attached to: every sequence it held is gone. Clients that cannot be moved
    to another worker see UNAVAILABLE."""
