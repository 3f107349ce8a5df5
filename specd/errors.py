"""Errors the engines raise; the gRPC layer maps `code` to a grpc.StatusCode
of the same name. Engines stay free of grpc."""
from __future__ import annotations


class SpecdError(Exception):
    code = "INTERNAL"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(SpecdError):
    """`field`: the request field that was wrong, as a path into the request
    message ("speculative.n_max", "stop[2]"); public errors carry it as a
    google.rpc.BadRequest field violation."""

    code = "INVALID_ARGUMENT"

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


class FailedPrecondition(SpecdError):
    code = "FAILED_PRECONDITION"


class OutOfRange(SpecdError):
    code = "OUT_OF_RANGE"


class NotFound(SpecdError):
    code = "NOT_FOUND"


class ResourceExhausted(SpecdError):
    """`retry_after`: seconds after which a retry may succeed (a full queue
    drains), sent as google.rpc.RetryInfo; 0 when retrying will not help."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after: float = 0.0):
        super().__init__(message)
        self.retry_after = retry_after


class PermissionDenied(SpecdError):
    """The worker belongs to another router (specd.ownership)."""

    code = "PERMISSION_DENIED"


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
