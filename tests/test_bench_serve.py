"""bench-serve against servers that misbehave the way peers do: no request may be lost to connection handling."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from verispec.bench.serve_load import _one_request
from verispec.cli import main

STUB = Path(__file__).with_name("stub_openai_server.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stub_command(port: int) -> str:
    return f"{sys.executable} {STUB} --port {port} --idle-close 1"


def wait_serving(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError(f"stub server at {url} did not come up")


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture
def stub_url():
    port = free_port()
    process = subprocess.Popen(stub_command(port).split())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(url)
        yield url
    finally:
        process.kill()
        process.wait()


def two_requests_with_an_idle_gap(url: str, retries: int):
    """Two requests on one pooled client, 1.3 s apart: the second goes out on a connection the server expired."""

    async def scenario():
        async with httpx.AsyncClient() as client:
            first = await _one_request(client, url + "/v1", "stub", {"id": "a", "prompt": "one two"}, 8, 0.0,
                                       time.perf_counter(), retries)
            await asyncio.sleep(1.3)
            second = await _one_request(client, url + "/v1", "stub", {"id": "b", "prompt": "three four five"}, 8,
                                        0.0, time.perf_counter(), retries)
        return first, second

    return asyncio.run(scenario())


def test_request_on_an_expired_keepalive_connection_is_sent_again_fresh(stub_url):
    first, second = two_requests_with_an_idle_gap(stub_url, retries=3)
    assert first.error is None and first.text == " one two" and first.retries == 0
    assert second.error is None, second.error
    assert second.text == " three four five" and second.completion_tokens == 3
    assert second.retries == 1


def test_without_retries_the_expired_connection_loses_the_request(stub_url):
    """The control: the stub really drops the request, so the test above can fail."""
    _, second = two_requests_with_an_idle_gap(stub_url, retries=0)
    assert second.error_type == "RemoteProtocolError"
    assert "without sending a response" in second.error


def test_bench_serve_starts_servers_per_turn_counts_errors_and_skips_what_cannot_run(tmp_path):
    workload = tmp_path / "prompts.jsonl"
    prompts = ["alpha beta", "gamma delta epsilon", "fail", "cut", "zeta eta"]
    workload.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": p}) for i, p in enumerate(prompts)))
    port, dead_port = free_port(), free_port()
    cannot_run = f"{sys.executable} -c \"import sys; print('peer: skipped: no AVX-512 here'); sys.exit(3)\""
    out = tmp_path / "out"
    code = main([
        "bench-serve", "--server", f"stub=http://127.0.0.1:{port}/v1", "--start", f"stub={stub_command(port)}",
        "--server", f"nope=http://127.0.0.1:{dead_port}/v1", "--start", f"nope={cannot_run}",
        "--workload", str(workload), "--concurrency", "1,2", "--requests-per-client", "5", "--max-tokens", "8",
        "--out", str(out),
    ])
    assert code == 1  # the 500 and the cut stream are errors, and errors fail the run
    results = json.loads((out / "results.json").read_text())
    assert [s["server"] for s in results["summaries"]] == ["stub", "stub"]
    assert results["meta"]["skipped"] == {"nope": "exited with code 3 before serving: peer: skipped: no AVX-512 here"}
    for summary, raw in zip(results["summaries"], results["raw"]):
        served = summary["requests"] - summary["errors"]
        assert summary["requests"] == 5 * summary["concurrency"]
        assert summary["errors_by_type"] == {"HTTP 500": summary["concurrency"],
                                             "RemoteProtocolError": summary["concurrency"]}
        assert summary["startup_seconds"] > 0
        # the stub's own counters over the turn: the measured requests only (the warm-up is excluded);
        # each served prompt of n words: one verify step, n drafted, n - 1 accepted
        tokens = summary["completion_tokens"]
        assert tokens == 7 * summary["concurrency"]  # 2 + 3 + 2 words per pass over the workload
        assert raw["server_counters"] == {"drafts": served, "draft_tokens": tokens, "accepted_tokens": tokens - served}
        assert summary["acceptance_rate"] == pytest.approx(4 / 7)
        assert summary["tokens_per_target_forward"] == pytest.approx(7 / 3)  # tokens / (tokens - accepted)
    report = (out / "report.md").read_text()
    assert "- nope: exited with code 3 before serving: peer: skipped: no AVX-512 here" in report
    assert "| stub | 2 |" in report and "(2 HTTP 500) (2 RemoteProtocolError)" in report
    assert port_is_free(port)  # the started server is stopped after its turn


def test_start_must_name_a_server(tmp_path):
    assert main(["bench-serve", "--server", "a=http://127.0.0.1:1/v1", "--start", "b=true", "--out", str(tmp_path)]) == 2
