"""Errors the coordinator answers with, independent of any API's wire format."""

from __future__ import annotations


class ApiError(Exception):
    """A request that cannot be served; `param` names the offending field when there is one."""

    def __init__(self, status: int, message: str, *, param: str | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or _DEFAULT_TYPES.get(status, "server_error")


OVERLOADED = "overloaded"  # error_type of a request refused because it cannot start before its deadline

_DEFAULT_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class WorkerError(ApiError):
    """A worker failed or timed out while serving a request."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(status, message)
