"""What stands between the network and the API: keys, allowed hosts, request ids, one error shape, the access log.

`RequestFrame` is the outermost layer of the app (pure ASGI, so streams pass untouched). For every
HTTP request it
  - takes the client's `x-request-id` (if it is a short plain token) or makes one, and echoes it;
  - refuses a `/v1/*` request without `Authorization: Bearer <key>` when keys are set (401);
  - turns any error response that is not JSON (a wrong Host, a refused CORS preflight) into
    OpenAI's `{"error": {...}}` shape;
  - ends an unexpected exception with a 500 whose body names the request id and nothing else, and
    logs the traceback under that id;
  - counts a client that went away as status 499 (nginx's "client closed request"), not an error;
  - writes one access-log line (text or JSON) per request, with the generation's figures when the
    route generated (`request.state.generation`, filled by the app).
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import ClientDisconnect

from verispec.serving.metrics import ServerMetrics
from verispec.serving.protocol import APIError

log = logging.getLogger("verispec.server")
access_log = logging.getLogger("verispec.access")

ACCESS_LOG_FORMATS = ("text", "json", "off")
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
CLIENT_CLOSED = 499  # the status a request whose client went away is counted under


@dataclass(frozen=True)
class ServerSettings:
    """How the app faces its clients (the transport's own limits: verispec.serving.http.TransportLimits)."""

    model_name: str
    max_request_bytes: int = 1 << 20  # larger bodies: 413
    api_keys: tuple[str, ...] = ()  # when set, every /v1/* request needs `Authorization: Bearer <one of them>`
    metrics_need_key: bool = False  # /metrics needs a key too (else open, like /health, for scrapers)
    body_timeout: float = 30.0  # seconds to receive a request's body once its headers arrived: 408
    request_timeout: float | None = None  # seconds a request may take; then it ends as if max_tokens were reached
    allowed_origins: tuple[str, ...] = ()  # CORS: browsers on these origins may call the API ("*": any)
    allowed_hosts: tuple[str, ...] = ()  # Host headers accepted (e.g. "api.example.com", "*.example.com"); empty: any
    docs: bool = False  # serve /docs and /openapi.json
    access_log: str = "text"  # "text", "json" (one JSON object per line) or "off"

    def __post_init__(self) -> None:
        if not self.model_name or "/" in self.model_name and self.model_name.startswith(("/", ".")):
            raise ValueError(f"served model name {self.model_name!r} looks like a path; give --served-model-name")
        if any(not key or key != key.strip() for key in self.api_keys):
            raise ValueError("an API key is empty or has surrounding spaces")
        if not self.body_timeout > 0:
            raise ValueError(f"body-timeout must be > 0 seconds, got {self.body_timeout}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request-timeout must be > 0 seconds, got {self.request_timeout}")
        if self.access_log not in ACCESS_LOG_FORMATS:
            raise ValueError(f"access-log must be one of {', '.join(ACCESS_LOG_FORMATS)}, got {self.access_log!r}")

    def needs_key(self, path: str) -> bool:
        if not self.api_keys:
            return False
        return path.startswith("/v1/") or path == "/v1" or (self.metrics_need_key and path == "/metrics")

    def key_matches(self, authorization: str | None) -> bool:
        """Whether `Authorization` carries one of the keys (every key compared in constant time)."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = token.strip().encode()
        return any([hmac.compare_digest(given, key.encode()) for key in self.api_keys])


def served_model_name(target: str) -> str:
    """The model id a server answers to by default: a catalog name as it is, a file's or directory's own name."""
    path = Path(target)
    if path.suffix == ".gguf":
        return path.stem
    return path.resolve().name if path.exists() else target


def request_id_of(scope) -> str:
    return scope.get("state", {}).get("request_id", "-")


class RequestFrame:
    """ASGI middleware: request ids, keys, one error shape, exceptions, metrics and the access log (see above)."""

    def __init__(self, app, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.app = app
        self.settings = settings
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        given = headers.get("x-request-id", "")
        request_id = given if _CLIENT_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        started = time.perf_counter()
        response = _Response(send, request_id)
        try:
            preflight = scope["method"] == "OPTIONS" and "access-control-request-method" in headers
            if self.settings.needs_key(scope["path"]) and not preflight \
                    and not self.settings.key_matches(headers.get("authorization")):
                given_any = "authorization" in headers
                message = ("Incorrect API key provided." if given_any else "Missing API key: send the header "
                           "'Authorization: Bearer <key>'.")
                await response.error(APIError(401, message, code="invalid_api_key",
                                              headers={"WWW-Authenticate": "Bearer"}))
            else:
                await self.app(scope, receive, response.send)
        except ClientDisconnect:
            response.status = CLIENT_CLOSED
        except Exception as error:  # noqa: BLE001 - the last line: logged under its id, answered without internals
            log.error("request %s failed: %s: %s", request_id, type(error).__name__, error, exc_info=error)
            if response.started:
                response.status = 500  # a stream cut short: the transport closes the connection
            else:
                await response.error(APIError(500, f"internal server error (request id {request_id}); the server "
                                              "log has the details", type="server_error", code="internal_error"))
        finally:
            status = CLIENT_CLOSED if response.status is None else response.status
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.http_request(route, status)
            if status >= 400 and status != CLIENT_CLOSED and response.error_type is not None:
                self.metrics.error(response.error_type, response.error_code)
            self._log(scope, request_id, status, time.perf_counter() - started, state.get("generation"))

    def _log(self, scope, request_id: str, status: int, seconds: float, generation: dict | None) -> None:
        if self.settings.access_log == "off" or not access_log.isEnabledFor(logging.INFO):
            return
        client = scope.get("client")
        entry = {
            "request_id": request_id, "client": f"{client[0]}:{client[1]}" if client else None,
            "method": scope["method"], "path": scope["path"], "status": status, "seconds": round(seconds, 4),
            **(generation or {}),
        }
        if self.settings.access_log == "json":
            access_log.info(json.dumps(entry, separators=(",", ":")))
            return
        figures = " ".join(f"{k}={v}" for k, v in (generation or {}).items() if v is not None)
        access_log.info(f'{entry["client"]} "{scope["method"]} {scope["path"]}" {status} {seconds:.3f}s '
                        f"id={request_id} {figures}".rstrip())


class _Response:
    """The request's side of `send`: adds x-request-id, records the status, and rewrites a non-JSON error
    body into OpenAI's shape (those come from Starlette's own middleware: a wrong Host, a refused preflight)."""

    def __init__(self, send, request_id: str) -> None:
        self._send = send
        self.request_id = request_id
        self.status: int | None = None
        self.started = False
        self.error_type: str | None = None
        self.error_code: str | None = None
        self._held: dict | None = None  # a non-JSON error's start message, while its body is collected
        self._held_body = bytearray()

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.status = message["status"]
            headers = MutableHeaders(raw=list(message.get("headers", [])))
            headers["x-request-id"] = self.request_id
            message = {**message, "headers": headers.raw}
            if self.status >= 400:
                if not headers.get("content-type", "").startswith("application/json"):
                    self._held = message  # the app's own errors are JSON (and counted by its handler)
                    return
        elif message["type"] == "http.response.body" and self._held is not None:
            self._held_body += message.get("body", b"")
            if message.get("more_body", False):
                return
            start, self._held = self._held, None
            text = self._held_body.decode("utf-8", "replace").strip() or HTTPStatus(self.status).phrase
            headers = MutableHeaders(raw=start["headers"])
            del headers["content-length"]
            del headers["content-type"]
            self.started = False
            await self.error(APIError(self.status, text, code=HTTPStatus(self.status).phrase.lower().replace(" ", "_")),
                             headers.raw)
            return
        await self._send(message)

    async def error(self, error: APIError, raw_headers: list | None = None) -> None:
        """Answer with `error` (nothing was sent yet)."""
        body = json.dumps(error.body()).encode()
        headers = MutableHeaders(raw=list(raw_headers or []))
        for name, value in (error.headers or {}).items():
            headers[name] = value
        headers["content-type"] = "application/json"
        headers["content-length"] = str(len(body))
        headers["x-request-id"] = self.request_id
        self.status, self.error_type, self.error_code, self.started = error.status, error.type, error.code, True
        await self._send({"type": "http.response.start", "status": error.status, "headers": headers.raw})
        await self._send({"type": "http.response.body", "body": body})
