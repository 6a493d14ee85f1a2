"""`verispec serve` on a network: API keys, timeouts, connection limits, one error shape, request ids, logs.

A live server process (module scope) with two keys and short timeouts is probed with the official
openai client, httpx and raw sockets (malformed HTTP, slow headers, short bodies); in-process apps
cover what needs a hand on the scheduler (a deadline, an unexpected failure, CORS).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import select
import socket
import threading
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from servers import running_server
from verispec.serving.app import create_app
from verispec.serving.guard import ServerSettings, served_model_name
from verispec.serving.metrics import ServerMetrics
from verispec.serving.scheduler import Scheduler, SchedulerLimits

# A server under a loaded machine (the suite's other worker, a model loading) may take seconds to answer; what these
# tests check is what it answers, so they wait as long as the openai clients below do rather than httpx's 5 s.
post = functools.partial(httpx.post, timeout=60)
get = functools.partial(httpx.get, timeout=60)

KEY, OTHER_KEY = "sk-verispec-test-1", "sk-verispec-test-2"
HEADER_TIMEOUT = BODY_TIMEOUT = 1.0
MAX_CONNECTIONS = 12
SLACK = 2.0  # seconds a timeout may take beyond its own on a loaded 2-core machine


@pytest.fixture(scope="module")
def guarded(tiny_dir, other_tiny_dir, tmp_path_factory):
    """(base URL, log path) of a server with two keys, short timeouts, a Host allow-list and a JSON access log."""
    log_path = tmp_path_factory.mktemp("guarded") / "server.log"
    arguments = [
        "--target", str(tiny_dir), "--draft", str(other_tiny_dir), "--dtype", "float32", "--threads", "1", "--k", "3",
        "--api-key", KEY, "--api-key", OTHER_KEY, "--header-timeout", str(HEADER_TIMEOUT),
        "--body-timeout", str(BODY_TIMEOUT), "--keep-alive-timeout", "1", "--max-connections", str(MAX_CONNECTIONS),
        "--max-request-bytes", str(2 << 20), "--allowed-hosts", "127.0.0.1,localhost", "--access-log", "json",
    ]
    with running_server(arguments, log_path) as url:
        yield url, log_path


def authorized(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def model_id(url: str) -> str:
    return get(f"{url}/v1/models", headers=authorized()).json()["data"][0]["id"]


def is_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def raw_exchange(url: str, payload: bytes, wait: float = 10.0) -> tuple[bytes, float]:
    """Send raw bytes, read until the server closes: (everything it sent, seconds until it closed)."""
    host, port = url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(payload)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received, time.monotonic() - started


def parse_raw(response: bytes) -> tuple[int, dict, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body)


# -- keys -----------------------------------------------------------------------------------------------


def test_a_wrong_or_missing_key_is_refused_and_either_key_works(guarded):
    url, _ = guarded
    name = model_id(url)
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=name, prompt="def", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    missing = post(f"{url}/v1/completions", json={"model": name, "prompt": "def", "max_tokens": 2})
    error = is_openai_error(missing, 401)
    assert error["code"] == "invalid_api_key" and "Authorization: Bearer" in error["message"]
    assert missing.headers["www-authenticate"] == "Bearer"
    for key in (KEY, OTHER_KEY):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
        assert client.completions.create(model=name, prompt="def", max_tokens=2).usage.completion_tokens == 2
    assert get(f"{url}/health").status_code == 200  # open: load balancers probe it without a key
    assert "verispec_http_requests" in get(f"{url}/metrics").text


def test_the_model_id_is_the_directorys_name_never_a_path(guarded, tiny_dir):
    url, _ = guarded
    assert model_id(url) == tiny_dir.name
    error = is_openai_error(post(f"{url}/v1/completions", headers=authorized(),
                                       json={"model": "other", "prompt": "x"}), 404)
    assert str(tiny_dir.parent) not in error["message"]
    assert served_model_name(str(tiny_dir)) == tiny_dir.name
    assert served_model_name("/models/qwen.Q4_K_M.gguf") == "qwen.Q4_K_M"
    assert served_model_name("qwen2.5-coder-1.5b-instruct") == "qwen2.5-coder-1.5b-instruct"


def test_docs_are_off_and_a_foreign_host_is_refused(guarded):
    url, _ = guarded
    for path in ("/docs", "/openapi.json"):
        is_openai_error(get(f"{url}{path}"), 404)
    error = is_openai_error(get(f"{url}/health", headers={"Host": "evil.example"}), 400)
    assert "host" in error["message"].lower()


def test_the_body_must_be_json(guarded):
    url, _ = guarded
    body = json.dumps({"model": model_id(url), "prompt": "def", "max_tokens": 2}).encode()
    for content_type in (None, "text/plain", "application/x-www-form-urlencoded"):
        headers = authorized() | ({"Content-Type": content_type} if content_type else {})
        response = post(f"{url}/v1/completions", content=body, headers=headers)
        assert is_openai_error(response, 415)["code"] == "unsupported_media_type"


# -- the transport: malformed HTTP, slow clients, too many connections -----------------------------------


def test_malformed_http_gets_an_openai_shaped_400(guarded):
    url, _ = guarded
    for garbage in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n"):
        status, headers, body = parse_raw(raw_exchange(url, garbage)[0])
        assert status == 400 and headers["content-type"] == "application/json"
        assert body["error"]["code"] == "bad_http_request"


def test_slow_headers_and_silent_connections_are_closed_within_the_header_timeout(guarded):
    url, _ = guarded
    host, port = url.removeprefix("http://").split(":")
    silent = [socket.create_connection((host, int(port)), timeout=10) for _ in range(3)]
    dribbling = socket.create_connection((host, int(port)), timeout=10)
    started = time.monotonic()
    dribbling.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    received = b""
    with dribbling:
        for letter in b"X-Slow: " * 40:  # a byte every 0.1 s until it answers: the deadline is not per byte
            if select.select([dribbling], [], [], 0.1)[0]:
                break
            dribbling.sendall(bytes([letter]))
        answered = time.monotonic()
        while chunk := dribbling.recv(65536):
            received += chunk
    assert answered - started < HEADER_TIMEOUT + SLACK
    status, _, body = parse_raw(received)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    for sock in silent:
        with sock:
            assert parse_raw(sock.recv(65536))[0] == 408
            assert sock.recv(65536) == b""  # closed
    assert time.monotonic() - started < HEADER_TIMEOUT + SLACK + 2


def test_a_body_shorter_than_its_length_is_refused_within_the_body_timeout(guarded):
    url, _ = guarded
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    received, seconds = raw_exchange(url, head + b'{"model": "x"')
    status, _, body = parse_raw(received)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert BODY_TIMEOUT - 0.1 < seconds < BODY_TIMEOUT + SLACK


def test_an_oversized_body_gets_its_413_while_the_client_is_still_sending(guarded):
    """Refused from its Content-Length, the body is not read; closing at once with it unread made the kernel reset
    the connection, and a client still uploading lost the 413 (httpx.ReadError, a quarter of such requests from
    six clients). The server half-closes and drains what still comes before closing."""
    url, _ = guarded
    body = {"model": model_id(url), "prompt": "x" * (3 << 20), "max_tokens": 4}

    async def client() -> list[int | str]:
        statuses: list[int | str] = []
        async with httpx.AsyncClient(timeout=30) as http:
            for _ in range(8):
                try:
                    response = await http.post(f"{url}/v1/completions", json=body, headers=authorized())
                    statuses.append(response.status_code)
                except httpx.TransportError as error:
                    statuses.append(type(error).__name__)
        return statuses

    async def clients() -> list[list[int | str]]:
        return await asyncio.gather(*(client() for _ in range(6)))

    assert asyncio.run(clients()) == [[413] * 8] * 6


def test_connections_beyond_the_cap_are_answered_503(guarded):
    url, _ = guarded
    host, port = url.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        status, _, body = parse_raw(raw_exchange(url, b"")[0])
        assert status == 503 and body["error"]["code"] == "too_many_connections"
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while get(f"{url}/health").status_code != 200:  # the held ones are gone: served again
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_client_leaving_while_its_body_is_read_is_no_error(guarded):
    url, log_path = guarded
    before = log_path.read_text()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + b'{"model"')
        time.sleep(0.2)
    time.sleep(0.5)
    added = log_path.read_text()[len(before):]
    assert "Traceback" not in added and "ERROR" not in added
    lines = [json.loads(line) for line in added.splitlines() if line.startswith("{")]
    assert any(line["status"] == 499 and line["path"] == "/v1/completions" for line in lines)
    metrics = get(f"{url}/metrics").text
    assert 'status="499"' in metrics


def test_a_client_giving_up_on_a_whole_response_is_no_error(guarded):
    """The request is cancelled and counted as 499 (client closed request), not as the server's 503."""
    url, log_path = guarded
    body = {"model": model_id(url), "prompt": "def add(a, b):", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        post(f"{url}/v1/completions", json=body, headers=authorized() | {"x-request-id": "gives-up"}, timeout=0.2)
    deadline = time.monotonic() + 10
    while '"gives-up"' not in log_path.read_text():
        assert time.monotonic() < deadline, "the abandoned request never reached the access log"
        time.sleep(0.05)
    line = next(json.loads(x) for x in log_path.read_text().splitlines() if '"gives-up"' in x)
    assert line["status"] == 499 and line["finish_reason"] == "cancelled"
    assert 'code="cancelled"' not in get(f"{url}/metrics").text
    while get(f"{url}/health").json()["active"]:  # its sequence is freed at the scheduler's next step
        assert time.monotonic() < deadline + 5, "the abandoned request's sequence was never freed"
        time.sleep(0.05)


# -- request ids and the access log ---------------------------------------------------------------------


def test_request_ids_are_echoed_and_the_access_log_has_the_generations_figures(guarded):
    url, log_path = guarded
    body = {"model": model_id(url), "prompt": "def add(a, b):", "max_tokens": 12, "ignore_eos": True}
    response = post(f"{url}/v1/completions", json=body, headers=authorized() | {"x-request-id": "trace-42"})
    assert response.status_code == 200 and response.headers["x-request-id"] == "trace-42"
    made = get(f"{url}/health").headers["x-request-id"]
    assert len(made) == 32 and made != "trace-42"
    bad = get(f"{url}/health", headers={"x-request-id": "has spaces and\ttabs"}).headers["x-request-id"]
    assert " " not in bad
    deadline = time.monotonic() + 5
    while '"trace-42"' not in log_path.read_text():
        assert time.monotonic() < deadline, "the request never reached the access log"
        time.sleep(0.05)
    line = next(json.loads(x) for x in log_path.read_text().splitlines() if '"trace-42"' in x)
    assert line["status"] == 200 and line["model"] == body["model"] and line["drafter"]
    assert line["prompt_tokens"] > 0 and line["completion_tokens"] == 12 and line["finish_reason"] == "length"
    assert line["ttft_s"] > 0 and line["tokens_per_s"] > 0 and 0 <= line["acceptance"] <= 1


# -- a huge request does not stall the others -----------------------------------------------------------


STALL_FLOOR = 1.0  # seconds of silence a loaded 2-core machine may cause without any stall by the server
STALL_CEILING = 3.0  # seconds of silence that are a stall however long the big request takes


def longest_silence(stamps: list[float], start: float, end: float) -> tuple[float, int]:
    """(the longest time between start and end without a stream event, how many events came in between)."""
    heard = [t for t in stamps if start < t < end]
    points = [start, *heard, end]
    return max(b - a for a, b in zip(points, points[1:])), len(heard)


def test_a_one_megabyte_prompt_does_not_stall_a_running_stream(guarded):
    """Tokenizing a 1 MB prompt (then refusing it: longer than the context) happens off the event loop, so a
    running stream keeps producing meanwhile. Only what a busy machine cannot fake is asserted, no comparison of
    latencies (a shared machine spreads them): events arrive during the big request, and no silence comes near its
    whole duration. A server that stalled the stream for the tokenization would hold its events until the
    tokenization ended: none before the 400, or one burst just before it, and a silence as long as the request."""
    url, _ = guarded
    name = model_id(url)
    stamps: list[float] = []
    stream_ended: list[float] = []

    def stream() -> None:
        body = {"model": name, "prompt": "def", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=authorized(), timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.perf_counter())
        stream_ended.append(time.perf_counter())

    text = ("def add(a, b):\n    return a + b  # a comment to tokenize\n" * 20000)[:1_000_000]
    streaming = threading.Thread(target=stream)
    streaming.start()
    while len(stamps) < 40:
        assert streaming.is_alive(), "the stream ended early"
        time.sleep(0.01)
    big_start = time.perf_counter()
    response = post(f"{url}/v1/completions", headers=authorized(), timeout=120,
                          json={"model": name, "prompt": text, "max_tokens": 1})
    big_end = time.perf_counter()
    streaming.join(timeout=120)
    assert is_openai_error(response, 400)["param"] == "prompt"  # tokenized, then refused: longer than the context
    assert stream_ended and stream_ended[0] > big_start, "the stream ended before the big request began"
    # A stream that ended before the big request did was not stalled: a stalled one cannot end before the stall.
    window = min(big_end, stream_ended[0]) - big_start
    silence, heard = longest_silence(stamps, big_start, big_start + window)
    assert heard > 0, f"no stream event in the {window:.3f} s the stream and the big request overlapped"
    # a stall is as long as the tokenization: caught wherever that outlasts what a busy machine may pause
    assert silence <= min(STALL_CEILING, max(window / 2, STALL_FLOOR)), (silence, window, heard)


# -- in-process: a deadline, an unexpected failure, CORS -------------------------------------------------


@pytest.fixture
def slow_scheduler(target):
    """A started scheduler whose steps take at least 20 ms each."""
    scheduler = Scheduler(target, limits=SchedulerLimits(max_batch_size=4, max_context=512))
    step = scheduler._step

    def slow_step() -> None:
        time.sleep(0.02)
        step()

    scheduler._step = slow_step
    scheduler.start()
    yield scheduler
    scheduler.stop()


def test_a_request_past_its_deadline_ends_with_what_it_has(slow_scheduler):
    settings = ServerSettings("tiny", request_timeout=0.5)
    with TestClient(create_app(slow_scheduler, ServerMetrics(), settings)) as http:
        body = {"prompt": "def", "max_tokens": 400, "ignore_eos": True}
        started = time.monotonic()
        whole = http.post("/v1/completions", json=body).json()
        assert time.monotonic() - started < 0.5 + SLACK
        assert whole["choices"][0]["finish_reason"] == "length"
        assert 0 < whole["usage"]["completion_tokens"] < 400
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 5
    while slow_scheduler.num_active or slow_scheduler.num_waiting:  # the sequences were freed
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_an_unexpected_failure_is_a_500_with_a_request_id_and_no_internals(target, caplog):
    scheduler = Scheduler(target, limits=SchedulerLimits(max_batch_size=1, max_context=64))
    scheduler.start()

    def broken(*args, **kwargs):
        raise RuntimeError("grammar engine state: secret internals")

    scheduler.submit_choices = broken
    try:
        with TestClient(create_app(scheduler, ServerMetrics(), ServerSettings("tiny"))) as http, \
                caplog.at_level(logging.ERROR, logger="verispec.server"):
            response = http.post("/v1/completions", json={"prompt": "def", "max_tokens": 2},
                                 headers={"x-request-id": "boom-1"})
    finally:
        scheduler.stop()
    error = is_openai_error(response, 500)
    assert "boom-1" in error["message"] and "secret" not in error["message"] and "RuntimeError" not in error["message"]
    logged = [r for r in caplog.records if "boom-1" in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the traceback, under the request's id


def test_cors_is_opt_in(target):
    scheduler = Scheduler(target, limits=SchedulerLimits(max_batch_size=1, max_context=64))  # not started
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    settings = ServerSettings("tiny", api_keys=(KEY,), allowed_origins=("https://app.example",))
    with TestClient(create_app(scheduler, ServerMetrics(), settings)) as http:
        allowed = http.options("/v1/completions", headers=preflight)
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        refused = http.options("/v1/completions", headers=preflight | {"Origin": "https://evil.example"})
        is_openai_error(refused, 400)
    with TestClient(create_app(scheduler, ServerMetrics(), ServerSettings("tiny"))) as http:
        response = http.get("/v1/models", headers={"Origin": "https://app.example"})
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


def test_bad_server_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="looks like a path"):
        ServerSettings("/home/me/models/qwen")
    with pytest.raises(ValueError, match="request-timeout"):
        ServerSettings("m", request_timeout=0)
    with pytest.raises(ValueError, match="access-log"):
        ServerSettings("m", access_log="xml")
    with pytest.raises(ValueError, match="API key"):
        ServerSettings("m", api_keys=(" spaced ",))


def test_ray_replicas_take_the_same_settings(tiny_dir):
    from verispec.serving.ray_serve import ReplicaSettings

    replica = ReplicaSettings(target=str(tiny_dir), api_keys=[KEY], request_timeout=30, access_log="json",
                              allowed_hosts=["api.example.com"])
    settings = replica.server_settings()
    assert settings.api_keys == (KEY,) and settings.request_timeout == 30 and settings.access_log == "json"
    assert settings.model_name == tiny_dir.name and settings.allowed_hosts == ("api.example.com",)
    with pytest.raises(ValueError, match="access-log"):
        ReplicaSettings(access_log="xml").server_settings()
