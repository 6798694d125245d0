"""The HTTP server of a registered version: MLflow's scoring server (``mlflow.pyfunc.scoring_server``, the app
``mlflow models serve`` runs) behind :class:`RequestGuard`, started by ``python -m pipelines.serve``.

MLflow's server reads any body whole and, when it cannot parse it, answers with the parse error *and the body*
(``Ensure that input is a valid JSON formatted string ... Input: <the body>``): a 1 MB body that is not JSON gets
a 1 MB answer, 1 MB of bytes that are not UTF-8 a 10 MB one. It takes ``NaN`` in JSON for a value and the model
then sees a missing one. The guard, an ASGI wrapper around that app, answers ``/invocations`` itself, in one
short line and without the body, when the request

- is larger than ``max_body_bytes`` (``ADLM_MAX_BODY_BYTES``, default 1 MiB): 413, read no further than the
  limit (a ``Content-Length`` over it is refused before any byte is read);
- is not ``application/json`` (the served model's format): 415;
- is not UTF-8, not JSON, or holds ``NaN``, ``Infinity`` or a number too large for a float: 400.

A request that passes goes to MLflow's app unchanged. Whatever that app answers with a 4xx or 5xx status is cut
to its first line (at most ``MAX_MESSAGE`` characters), so no error message carries a request back.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

DEFAULT_MAX_BODY_BYTES = 1 << 20
"""1 MiB: 16 rows (``ADLM_MAX_ROWS``) of prompts and suffixes of tens of kilobytes each."""
BODY_ENV = "ADLM_MAX_BODY_BYTES"
MAX_MESSAGE = 500
"""Characters of an error message the server sends back (its first line)."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyError(ValueError):
    """A request body the guard refuses: ``status`` and one line."""

    def __init__(self, status: int, message: str, code: str = "BAD_REQUEST") -> None:
        super().__init__(message)
        self.status, self.code = status, code


def max_body_bytes(environ: MutableMapping[str, str] | None = None) -> int:
    """``ADLM_MAX_BODY_BYTES`` (a positive integer), default ``DEFAULT_MAX_BODY_BYTES``; a one-line
    ``SettingError`` for anything else (``pipelines.settings``)."""
    from pipelines.settings import env_number

    return int(env_number(BODY_ENV, DEFAULT_MAX_BODY_BYTES, os.environ if environ is None else environ))


def _no_constant(name: str) -> Any:
    raise BodyError(400, f"the body holds {name}, which is not a JSON number: send a finite number or leave the "
                         "field out for its default", "INVALID_PARAMETER_VALUE")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BodyError(400, f"the body holds the number {text[:40]}, too large for a float", "INVALID_PARAMETER_VALUE")
    return value


def check_body(body: bytes, content_type: str | None) -> None:
    """BodyError (one line, never the body) unless ``body`` is UTF-8 JSON without NaN or infinities."""
    mime = (content_type or "").split(";")[0].strip().lower()
    if mime != "application/json":
        raise BodyError(415, f"the served model takes Content-Type application/json, got {mime or 'none'!r}",
                        "BAD_REQUEST")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"the body is not UTF-8 (byte {e.start} cannot be decoded): send JSON text in UTF-8") \
            from None
    try:
        json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except json.JSONDecodeError as e:
        raise BodyError(400, f"the body is not JSON ({e.msg} at line {e.lineno} column {e.colno}): send "
                             '{"dataframe_records": [{"prompt": ...}]} or {"inputs": ...}') from None


def short_error(body: bytes, status: int = 400) -> bytes:
    """An error answer cut to its first line: MLflow's JSON ``message`` (other fields kept, its stack trace
    dropped), or any other body as such a JSON (the timeout's plain-text 504, ...)."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("message"), str):
        obj = {k: v for k, v in obj.items() if k != "stack_trace"}
        obj["message"] = _line(obj["message"])
        return json.dumps(obj).encode()
    code = "INTERNAL_ERROR" if status >= 500 else "BAD_REQUEST"
    return json.dumps({"error_code": code, "message": _line(body.decode("utf-8", "replace"))}).encode()


def _line(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first if len(first) <= MAX_MESSAGE else first[:MAX_MESSAGE] + " ..."


async def _answer(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"error_code": code, "message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class RequestGuard:
    """ASGI wrapper of the scoring app (module docstring)."""

    def __init__(self, app: ASGIApp, max_body: int = DEFAULT_MAX_BODY_BYTES, path: str = "/invocations") -> None:
        self.app, self.max_body, self.path = app, max_body, path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") != self.path or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        too_big = (f"the body is larger than the server's limit of {self.max_body:,} bytes ({BODY_ENV}): split the "
                   "request or raise the limit")
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.strip().isdigit() or int(declared) > self.max_body):
            await _answer(send, 413, "REQUEST_LIMIT_EXCEEDED", too_big)
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = bool(message.get("more_body", False))
            if len(body) > self.max_body:
                await _answer(send, 413, "REQUEST_LIMIT_EXCEEDED", too_big)
                return
        ctype = headers.get(b"content-type")
        try:
            check_body(bytes(body), ctype.decode("latin-1") if ctype else None)
        except BodyError as e:
            await _answer(send, e.status, e.code, str(e))
            return
        await self.app(scope, _replay(bytes(body), receive), _cut_errors(send))


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read once more, for the wrapped app; then the connection's own messages (a disconnect)."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def _cut_errors(send: Send) -> Send:
    """``send`` with a 4xx/5xx answer held back until whole and cut to its first line (``short_error``)."""
    held: dict[str, Any] = {}
    chunks: list[bytes] = []

    async def cut(message: Message) -> None:
        if message["type"] == "http.response.start" and int(message["status"]) >= 400:
            held["start"] = message
            return
        if "start" not in held:
            await send(message)
            return
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        start = dict(held["start"])
        body = short_error(b"".join(chunks), int(start["status"]))
        start["headers"] = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length",
                                                                                              b"content-type")]
        start["headers"] += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send(start)
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return cut


MODEL_PATH_ENV = "MLFLOW_MODEL_PATH_FOR_ADLM_SERVER"
"""Where ``create_app`` finds the MLflow Model folder (set by ``python -m pipelines.serve`` for its workers)."""


def create_app() -> RequestGuard:
    """MLflow's scoring app for the model folder ``$MLFLOW_MODEL_PATH_FOR_ADLM_SERVER`` behind the guard (the
    factory each uvicorn worker calls)."""
    from mlflow.pyfunc import scoring_server

    model = scoring_server.load_model_with_mlflow_config(os.environ[MODEL_PATH_ENV])
    return RequestGuard(scoring_server.init(model), max_body_bytes())


__all__ = ["BODY_ENV", "DEFAULT_MAX_BODY_BYTES", "BodyError", "RequestGuard", "check_body", "create_app",
           "max_body_bytes", "short_error"]
