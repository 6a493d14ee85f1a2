"""The HTTP transport under the app: uvicorn's h11 protocol with the limits a server on a network needs.

Uvicorn times out idle keep-alive connections only: a client that opens a connection and dribbles
its headers (or never sends them) holds it forever, and malformed HTTP gets a plain-text 400. Here
each connection gets `header_timeout` seconds to send a request's line and headers, a server holds
at most `max_connections` connections, and every answer the transport gives itself (a malformed
request, a header timeout, too many connections) is JSON in OpenAI's error shape, like the app's. A
connection closed while its request's body still comes lingers (half-closed, drained) so that a client
still uploading gets its answer instead of a reset.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from dataclasses import dataclass
from http import HTTPStatus

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from verispec.serving.protocol import APIError

log = logging.getLogger("verispec.http")


@dataclass(frozen=True)
class TransportLimits:
    header_timeout: float = 10.0  # seconds from a connection (or a request's first byte) to its complete headers
    keep_alive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open
    max_connections: int = 256  # more are answered 503 and closed
    graceful_shutdown: float = 5.0  # seconds streams get to finish on shutdown

    def __post_init__(self) -> None:
        for name in ("header_timeout", "keep_alive_timeout", "graceful_shutdown"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"max-connections must be >= 1, got {self.max_connections}")


def raw_error(error: APIError) -> bytes:
    """A whole HTTP/1.1 response carrying `error` in OpenAI's shape, closing the connection."""
    body = json.dumps(error.body()).encode()
    head = (
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


# A connection closed while its request's body is still coming (refused from its Content-Length, or not in time)
# is first half-closed and drained, as nginx's lingering close does: closed at once with unread data, the kernel
# resets it, and a client still uploading loses the answer. Drained until the client's FIN, a pause of
# LINGER_IDLE, LINGER_SECONDS in all or LINGER_BYTES.
LINGER_IDLE = 1.0
LINGER_SECONDS = 5.0
LINGER_BYTES = 64 << 20


class _LingeringClose:
    """The transport as the protocol and its request cycles see it: close() lingers (GuardedH11Protocol._linger)."""

    def __init__(self, transport: asyncio.Transport, linger) -> None:
        self._transport = transport
        self._linger = linger

    def close(self) -> None:
        self._linger()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with a header deadline, a connection cap, JSON errors and a lingering close (limits: set on a
    subclass)."""

    limits: TransportLimits = TransportLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._raw_transport = transport
        self._lingering: asyncio.TimerHandle | None = None
        self._drained = 0
        self.transport = _LingeringClose(transport, self._linger)
        if len(self.connections) > self.limits.max_connections:
            message = f"the server holds {self.limits.max_connections} connections already (--max-connections); retry later"
            log.warning("refused a connection from %s: %s", self.client, message)
            self._answer_and_close(APIError(503, message, type="server_error", code="too_many_connections"))
            return
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:  # closing: what the client still sends is read and dropped
            self._drained += len(data)
            self._lingering.cancel()
            if self._drained > LINGER_BYTES or self.loop.time() > self._linger_until:
                self._raw_transport.close()
            else:
                self._lingering = self.loop.call_later(LINGER_IDLE, self._raw_transport.close)
            return
        if self._header_deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._await_headers()  # a new request's first bytes on a kept-alive connection
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # its headers arrived: the app reads the body (with its own deadline)
            self._stop_awaiting_headers()

    def eof_received(self) -> None:
        if self._lingering is not None:  # the client has sent everything: close now
            self._raw_transport.close()
            return
        super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_awaiting_headers()
        if self._lingering is not None:
            self._lingering.cancel()
        super().connection_lost(exc)

    def _linger(self) -> None:
        """Close: at once unless a request's body is still coming; then half-close (our answer is flushed, then a
        FIN) and drop what still arrives (data_received) until the client's FIN or a limit (LINGER_*)."""
        transport = self._raw_transport
        if transport.is_closing() or self._lingering is not None:
            return
        if self.conn.their_state is not h11.SEND_BODY or not transport.can_write_eof():
            transport.close()
            return
        self._stop_awaiting_headers()
        transport.write_eof()
        transport.resume_reading()
        self._linger_until = self.loop.time() + LINGER_SECONDS
        self._lingering = self.loop.call_later(LINGER_IDLE, transport.close)

    def send_400_response(self, msg: str) -> None:
        self._stop_awaiting_headers()
        self._answer_and_close(APIError(400, f"malformed HTTP request: {msg}", code="bad_http_request"))

    def _await_headers(self) -> None:
        self._header_deadline = self.loop.call_later(self.limits.header_timeout, self._headers_too_slow)

    def _stop_awaiting_headers(self) -> None:
        if getattr(self, "_header_deadline", None) is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered (its headers completed in the same instant)
        message = f"the request's headers did not arrive within {self.limits.header_timeout:g} s (--header-timeout)"
        self._answer_and_close(APIError(408, message, code="request_timeout"))

    def _answer_and_close(self, error: APIError) -> None:
        if not self._raw_transport.is_closing() and self._lingering is None:
            self._raw_transport.write(raw_error(error))
            self._raw_transport.close()


def configure_server_logging(level: int = logging.INFO) -> None:
    """The server's logs on stderr: verispec's own lines with time and level, the access log as it is written
    (a JSON line stays a JSON line). For the server's process only: the library itself logs nothing here."""
    for name, layout in (("verispec", "%(asctime)s %(levelname)s %(name)s: %(message)s"),
                         ("verispec.access", "%(message)s")):
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(layout))
            logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False


def serve(app, sock: socket.socket, limits: TransportLimits, log_level: str = "info") -> None:
    """Run `app` on the listening `sock` until interrupted (uvicorn's access log off: the app writes its own)."""
    protocol = type("LimitedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
    config = uvicorn.Config(
        app, http=protocol, log_level=log_level, access_log=False, timeout_keep_alive=limits.keep_alive_timeout,
        timeout_graceful_shutdown=limits.graceful_shutdown, server_header=False,
    )
    uvicorn.Server(config).run(sockets=[sock])
