"""Errors in OpenAI's shape, with the HTTP status as an int `code` (vLLM's choice, which the
openai client reads): {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# SamplingParams names -> the API's names, for `param` in errors.
_API_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
              "bad_words_ids": "bad_words"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"),
                      "param": param, "code": status}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def from_value_error(exc: ValueError) -> ApiError:
    """A ValueError from SamplingParams.validate or the engine: 400, naming the field."""
    message = str(exc)
    match = re.search(r"sampling parameter (\w+)", message)
    param = _API_NAMES.get(match.group(1), match.group(1)) if match else None
    for internal, api in _API_NAMES.items():
        message = message.replace(internal, api)
    return ApiError(400, message, param)


def engine_dead() -> ApiError:
    return ApiError(503, "the engine process is not running; the server cannot serve requests")


async def read_raw_body(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The body's bytes: 413 past `limit` (declared or streamed), 408 when it takes longer than
    `timeout` seconds to arrive (a slow client must not hold a connection and a buffer forever),
    400 if the client hangs up."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes is larger than the limit of "
                       f"{limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"request body is larger than the limit of {limit} "
                                   "bytes")
                chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected while sending the request") from None
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s") from None
    return b"".join(chunks)


async def read_body(request: Request, model: type[BaseModel], limit: int,
                    timeout: float | None = None) -> Any:
    """The JSON body parsed into `model`: 413 past `limit` bytes, 400 for bad JSON or fields
    (never FastAPI's 422).

    pydantic's own JSON parser does the parsing: it refuses invalid UTF-8, lone surrogates
    (which could not be encoded for the engine, nor tokenized) and absurd nesting with a
    ValidationError, where json.loads would pass the first two and raise RecursionError."""
    raw = await read_raw_body(request, limit, timeout)
    if not raw.lstrip().startswith(b"{"):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> ApiError:
    errors = exc.errors(include_url=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('msg')}")
    loc = [str(p) for p in first.get("loc", ())]
    # Union members show up in the location (e.g. prompt.str): keep the field path only.
    param = loc[0] if loc else None
    where = ".".join(p for p in loc if not _is_type_name(p)) or "body"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return bad_request(f"invalid request: {where}: {first.get('msg', 'invalid value')}{more}",
                       param)


def _is_type_name(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list", "dict"} or part.startswith(
        ("list[", "dict[", "function-", "constrained-"))
