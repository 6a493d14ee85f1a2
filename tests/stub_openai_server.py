"""A small OpenAI-style streaming server that behaves like some peers do, for bench-serve's tests.

Run as a script: `python tests/stub_openai_server.py --port N [--idle-close SECONDS]`.

- Keep-alive connections idle for longer than `--idle-close` seconds are closed by the server; the
  client only notices when it sends its next request on one, which then gets no response at all
  (`Server disconnected without sending a response`), as with llama.cpp's server.
- `/v1/completions` streams the prompt's words back (at most `max_tokens` of them), one SSE chunk
  each, then a chunk with the finish reason ("length" when words were left over, else "stop") and
  one with usage, as verispec does. Prompt "fail" answers HTTP 500; prompt "cut" sends one chunk and
  drops the connection mid-stream. Failures a client could take for a short answer: prompt
  "error-event" sends one word, then verispec's error event, then `[DONE]`; "no-done" a whole
  stream, finish reason and usage included, but no `[DONE]` (the response still ends cleanly);
  "no-finish" one word, usage and `[DONE]` but no finish reason in any chunk. Prompts "whole" and
  "whole-no-finish" are answered as one JSON body, not streamed, with and without a finish reason.
- `/metrics` exports peer-style `spec_decode_*` counters: per completion of n words served, one
  verify step that drafted n tokens and accepted n - 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

COUNTERS = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}


def _response(status: str, body: bytes, content_type: str = "application/json") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _sse(payloads: list[dict], done: bool = True) -> bytes:
    events = b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads)
    return events + (b"data: [DONE]\n\n" if done else b"")


FAILURES = ("error-event", "no-done", "no-finish")
# What verispec's server sends when a sequence fails mid-stream (APIError.body(), then [DONE]).
ERROR_EVENT = {"error": {"message": "generation failed", "type": "server_error", "param": None,
                         "code": "generation_failed"}}


def _stream(prompt: str, max_tokens: int) -> bytes:
    """The SSE body of a streamed completion: the prompt's words back, or one of the failures above."""
    if prompt == "error-event":
        return _sse([{"choices": [{"index": 0, "text": " partial", "finish_reason": None}]}, ERROR_EVENT])
    if prompt == "no-finish":
        return _sse([{"choices": [{"index": 0, "text": " partial", "finish_reason": None}]},
                     {"choices": [], "usage": {"completion_tokens": 1}}])
    words = prompt.split()[:max_tokens]
    reason = "length" if len(prompt.split()) > max_tokens else "stop"
    chunks = [{"choices": [{"index": 0, "text": " " + w, "finish_reason": None}]} for w in words]
    chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": reason}]})
    chunks.append({"choices": [], "usage": {"completion_tokens": len(words)}})
    return _sse(chunks, done=prompt != "no-done")


def _metrics() -> bytes:
    lines = []
    for name, key in (("spec_decode_num_drafts_total", "drafts"), ("spec_decode_num_draft_tokens_total", "draft_tokens"),
                      ("spec_decode_num_accepted_tokens_total", "accepted_tokens")):
        lines += [f"# TYPE stub:{name} counter", f"stub:{name} {COUNTERS[key]}"]
    return ("\n".join(lines) + "\n").encode()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return method, path, body


def make_handler(idle_close: float):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        last_response = None
        try:
            while True:
                method, path, body = await _read_request(reader)
                if last_response is not None and time.monotonic() - last_response > idle_close:
                    return  # this connection had expired: close it without a response
                if method == "GET" and path == "/v1/models":
                    writer.write(_response("200 OK", json.dumps({"data": [{"id": "stub"}]}).encode()))
                elif method == "GET" and path == "/metrics":
                    writer.write(_response("200 OK", _metrics(), "text/plain"))
                elif method == "POST" and path == "/v1/completions":
                    request = json.loads(body)
                    prompt, max_tokens = request["prompt"], request.get("max_tokens", 16)
                    if prompt == "fail":
                        writer.write(_response("500 Internal Server Error", b'{"error": "stub failure"}'))
                    elif prompt == "cut":
                        whole = _response("200 OK", _sse([{"choices": [{"text": "half"}]}] * 4), "text/event-stream")
                        writer.write(whole[: len(whole) // 2])
                        await writer.drain()
                        return
                    elif prompt in ("whole", "whole-no-finish"):
                        choice = {"index": 0, "text": " whole answer"}
                        if prompt == "whole":
                            choice["finish_reason"] = "stop"
                        answer = {"choices": [choice], "usage": {"completion_tokens": 2}}
                        writer.write(_response("200 OK", json.dumps(answer).encode()))
                    else:
                        writer.write(_response("200 OK", _stream(prompt, max_tokens), "text/event-stream"))
                        words = [] if prompt in FAILURES else prompt.split()[:max_tokens]
                        # as if one verify step had drafted every word and accepted all but the last
                        if words:
                            COUNTERS.update(drafts=COUNTERS["drafts"] + 1,
                                            draft_tokens=COUNTERS["draft_tokens"] + len(words),
                                            accepted_tokens=COUNTERS["accepted_tokens"] + len(words) - 1)
                else:
                    writer.write(_response("404 Not Found", b"{}"))
                await writer.drain()
                last_response = time.monotonic()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return handle


async def serve(port: int, idle_close: float) -> None:
    server = await asyncio.start_server(make_handler(idle_close), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--idle-close", type=float, default=1.0)
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.idle_close))
