"""The HTTP server of a registered version: MLflow's scoring server (``mlflow.pyfunc.scoring_server``, the app
``mlflow models serve`` runs) behind :class:`RequestGuard`, started by ``python -m pipelines.serve``.

MLflow's server reads any body whole and, when it cannot parse it, answers with the parse error *and the body*
(``Ensure that input is a valid JSON formatted string ... Input: <the body>``): a 1 MB body that is not JSON gets
a 1 MB answer, 1 MB of bytes that are not UTF-8 a 10 MB one. It takes ``NaN`` in JSON for a value and the model
then sees a missing one. The guard, an ASGI wrapper around that app, answers ``/invocations`` itself, in one
short line and without the body, when the request

- is larger than ``max_body_bytes`` (``ADLM_MAX_BODY_BYTES``, default 1 MiB): 413, read no further than the
  limit (a ``Content-Length`` over it is refused before any byte is read);
- is not ``application/json`` (the served model's format; ``charset=utf-8`` the only parameter): 415;
- is not UTF-8, not JSON, nested deeper than ``MAX_NESTING`` levels, or holds ``NaN``, ``Infinity``, a number too
  large for a float or an integer of more than ``MAX_DIGITS`` digits: 400 (a JSON nested 100,000 deep and a
  5,000-digit integer were 500s with a traceback in the log).

A request that passes goes to MLflow's app unchanged. Whatever that app answers with a 4xx or 5xx status is cut
to its first line (at most ``MAX_MESSAGE`` characters), and every string the request sent (its keys and values,
its content type) is taken out of it (``scrub``): no error message carries any of a request back, from the model's
checks (which name a bad value) or from MLflow's (which name unknown keys).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pipelines.core.settings import env_number

DEFAULT_MAX_BODY_BYTES = 1 << 20
"""1 MiB: 16 rows (``ADLM_MAX_ROWS``) of prompts and suffixes of tens of kilobytes each."""
BODY_ENV = "ADLM_MAX_BODY_BYTES"
MAX_MESSAGE = 500
"""Characters of an error message the server sends back (its first line)."""
MAX_NESTING = 32
"""Levels of JSON nesting a request may have (the served formats use four)."""
MAX_DIGITS = 40
"""Digits an integer of a request may have (a seed is below 2**53: 16 digits)."""
SENT = "(the value sent)"
"""What an error message shows in place of a string the request sent."""

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
    ``SettingError`` for anything else (``pipelines.core.settings``)."""
    return int(env_number(BODY_ENV, DEFAULT_MAX_BODY_BYTES, os.environ if environ is None else environ))


def _no_constant(name: str) -> Any:
    raise BodyError(400, f"the body holds {name}, which is not a JSON number: send a finite number or leave the "
                         "field out for its default", "INVALID_PARAMETER_VALUE")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BodyError(400, "the body holds a number too large for a float: send a finite number",
                        "INVALID_PARAMETER_VALUE")
    return value


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise BodyError(400, f"the body holds an integer of more than {MAX_DIGITS} digits: no field takes one",
                        "INVALID_PARAMETER_VALUE")
    return int(text)


def _walk(obj: Any) -> tuple[int, set[str]]:
    """Levels of nesting of a parsed JSON value and every string in it, keys included (iteratively: no recursion
    on what a client sent)."""
    deepest, strings, todo = 0, set(), [(obj, 1)]
    while todo:
        o, d = todo.pop()
        if isinstance(o, str):
            strings.add(o)
        elif isinstance(o, dict | list):
            deepest = max(deepest, d)
            if isinstance(o, dict):
                strings.update(str(k) for k in o)
            todo.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest, strings


def check_body(body: bytes, content_type: str | None) -> Any:
    """The parsed body, or BodyError (one line, never any of the body) unless it is UTF-8 JSON without NaN or
    infinities, nested at most ``MAX_NESTING`` deep, sent as ``application/json``."""
    mime, *params = [part.strip().lower() for part in (content_type or "").split(";")]
    if mime != "application/json" or any(p.replace(" ", "") not in ("charset=utf-8", "") for p in params):
        raise BodyError(415, "the served model takes Content-Type application/json (charset=utf-8 its only "
                             "parameter)", "BAD_REQUEST")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"the body is not UTF-8 (byte {e.start} cannot be decoded): send JSON text in UTF-8") \
            from None
    try:
        parsed = json.loads(text, parse_constant=_no_constant, parse_float=_finite, parse_int=_integer)
    except json.JSONDecodeError as e:
        raise BodyError(400, f"the body is not JSON ({e.msg} at line {e.lineno} column {e.colno}): send "
                             '{"dataframe_records": [{"prompt": ...}]} or {"inputs": ...}') from None
    except RecursionError:
        parsed = None
    depth, strings = _walk(parsed)
    if parsed is None and text.strip() != "null" or depth > MAX_NESTING:
        raise BodyError(400, f"the body is JSON nested deeper than {MAX_NESTING} levels: send "
                             '{"dataframe_records": [{"prompt": ...}]} or {"inputs": ...}')
    for value in strings:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BodyError(400, "the body holds a string with a lone surrogate escape (\\ud800-\\udfff), which is "
                                 "no character: send text", "INVALID_PARAMETER_VALUE") from None
    return parsed


FORMAT_KEYS = ("dataframe_records", "dataframe_split", "inputs", "instances", "params", "columns", "data", "index")
"""The keys of MLflow's request formats."""


@functools.lru_cache(maxsize=1)
def known_words() -> frozenset[str]:
    """The server's own vocabulary, which a message may name though a request sent it too: the request fields, the
    formats' keys, the samplers and the cache modes (a message naming ``length`` echoes nothing of the client's)."""
    # lazy: keeps torch out of this module's import
    from adlm_model.kinds import SAMPLERS
    from adlm_model.sampling.confidence import KV_MODES
    from pipelines.tracking.mlflow_model import REQUEST_FIELDS

    return frozenset([*REQUEST_FIELDS, "num_samples", *FORMAT_KEYS, *SAMPLERS, *KV_MODES])


def sent_strings(parsed: Any, content_type: str | None = None) -> list[str]:
    """Every string a request sent (the parsed body's keys and values at any depth, the content type and its
    parts) but the server's own words (``known_words``), longest first: what ``scrub`` takes out of an answer."""
    found = _walk(parsed)[1]
    if content_type:
        found.add(content_type)
        for part in content_type.split(";"):
            found.update(x.strip() for x in (part, *part.split("=", 1)))
    known = known_words()
    return sorted((x for x in found if x and x not in known), key=len, reverse=True)


def scrub(message: str, sent: list[str]) -> str:
    """``message`` with every string of ``sent`` replaced by ``SENT``: quoted as Python or JSON writes it, and bare
    when it is four characters or longer (a shorter one bare is as likely the message's own word)."""
    for value in sent:
        for form in {repr(value), json.dumps(value), json.dumps(value, ensure_ascii=False), f"'{value}'",
                     f'"{value}"'}:
            message = message.replace(form, SENT)
        if len(value) >= 4:
            message = message.replace(value, SENT)
    return message


def short_error(body: bytes, status: int = 400, sent: list[str] | None = None) -> bytes:
    """An error answer cut to its first line with the request's strings (``sent``) taken out: MLflow's JSON
    ``message`` (``error_code`` kept, its stack trace dropped), or any other body as such a JSON (the timeout's
    plain-text 504, ...)."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        obj = None
    code = "INTERNAL_ERROR" if status >= 500 else "BAD_REQUEST"
    if isinstance(obj, dict) and isinstance(obj.get("message"), str):
        text = obj["message"]
        code = str(obj.get("error_code", code))[:64]
    else:
        text = body.decode("utf-8", "replace")
    return json.dumps({"error_code": code, "message": _line(scrub(text, sent or []))}).encode()


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
        content_type = ctype.decode("latin-1") if ctype else None
        try:
            parsed = check_body(bytes(body), content_type)
        except BodyError as e:
            await _answer(send, e.status, e.code, str(e))
            return
        await self.app(scope, _replay(bytes(body), receive), _cut_errors(send, sent_strings(parsed, content_type)))


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


def _cut_errors(send: Send, sent: list[str]) -> Send:
    """``send`` with a 4xx/5xx answer held back until whole, cut to its first line and the request's strings
    (``sent``) taken out (``short_error``)."""
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
        body = short_error(b"".join(chunks), int(start["status"]), sent)
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
    # lazy: keeps mlflow out of this module's import
    from mlflow.pyfunc import scoring_server

    model = scoring_server.load_model_with_mlflow_config(os.environ[MODEL_PATH_ENV])
    return RequestGuard(scoring_server.init(model), max_body_bytes())


__all__ = ["BODY_ENV", "DEFAULT_MAX_BODY_BYTES", "MAX_DIGITS", "MAX_NESTING", "BodyError", "RequestGuard", "check_body",
           "create_app", "max_body_bytes", "scrub", "sent_strings", "short_error"]
