"""APIError: a failure the gateway answers in OpenAI's error shape, with the right HTTP status.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}
"""

from __future__ import annotations

from typing import Any

__all__ = ["APIError", "bad_request", "not_found"]


class APIError(Exception):
    def __init__(self, status: int, message: str, error_type: str, *, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param=param, code=code)


def not_found(message: str, code: str = "not_found") -> APIError:
    return APIError(404, message, "invalid_request_error", code=code)
