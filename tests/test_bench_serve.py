"""bench-serve against servers that misbehave the way peers do: no request may be lost to connection handling,
and no failed request may pass for a short answer."""

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

from verispec.bench.serve_load import _one_request, run_level
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
    assert "commit" in results["meta"] and results["meta"]["machine_kind"]  # where it came from
    for summary, raw in zip(results["summaries"], results["raw"]):
        served = summary["requests"] - summary["errors"]
        assert summary["requests"] == 5 * summary["concurrency"]
        assert summary["errors_by_type"] == {"HTTP 500": summary["concurrency"],
                                             "RemoteProtocolError": summary["concurrency"]}
        assert summary["finish_reasons"] == {"stop": served}
        assert sorted(str(q["finish_reason"]) for q in raw["requests"] if q["error"] is None) == ["stop"] * served
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
    assert "| stub | 2 |" in report and "| 6 stop | 4 (2 HTTP 500) (2 RemoteProtocolError) |" in report
    assert port_is_free(port)  # the started server is stopped after its turn


def test_bench_serve_summary_fits_an_80_column_terminal(tmp_path, capsys, monkeypatch):
    """Its table folds cell by cell at 80 columns: there each server and level gets one line that fits."""
    monkeypatch.setenv("COLUMNS", "80")
    workload = tmp_path / "prompts.jsonl"
    workload.write_text('{"id": "p0", "prompt": "alpha beta"}\n{"id": "p1", "prompt": "zeta"}\n')
    port = free_port()
    out = tmp_path / "out"
    code = main([
        "bench-serve", "--server", f"stub-server=http://127.0.0.1:{port}/v1",
        "--start", f"stub-server={stub_command(port)}",
        "--workload", str(workload), "--concurrency", "1,2", "--requests-per-client", "1", "--max-tokens", "8",
        "--out", str(out),
    ])
    assert code == 0
    lines = capsys.readouterr().err.splitlines()
    assert max(map(len, lines)) <= 80, lines
    for summary in json.loads((out / "results.json").read_text())["summaries"]:
        throughput = f"{summary['throughput_tokens_per_second']:.2f}"
        assert any(line.startswith("stub-server ") and f" {summary['concurrency']} " in line and throughput in line
                   for line in lines), (summary, lines)


def test_start_must_name_a_server(tmp_path):
    assert main(["bench-serve", "--server", "a=http://127.0.0.1:1/v1", "--start", "b=true", "--out", str(tmp_path)]) == 2


def one_request(url: str, prompt: str, max_tokens: int = 8):
    async def scenario():
        async with httpx.AsyncClient() as client:
            return await _one_request(client, url + "/v1", "stub", {"id": prompt, "prompt": prompt}, max_tokens, 0.0,
                                      time.perf_counter())

    return asyncio.run(scenario())


def test_a_normal_stream_records_its_finish_reason(stub_url):
    stopped = one_request(stub_url, "one two", max_tokens=8)
    assert stopped.error is None, stopped.error
    assert stopped.finish_reason == "stop" and stopped.text == " one two" and stopped.completion_tokens == 2
    cut_short = one_request(stub_url, "a b c d e", max_tokens=3)
    assert cut_short.error is None, cut_short.error
    assert cut_short.finish_reason == "length" and cut_short.text == " a b c" and cut_short.completion_tokens == 3


def test_an_error_event_mid_stream_is_an_error_not_a_short_answer(stub_url):
    record = one_request(stub_url, "error-event")
    assert record.text == " partial"  # a first token did arrive, as in a short answer
    assert record.error_type == "error event"
    assert record.error == "error event: generation failed"  # verispec's message
    assert record.finish_reason is None and record.retries == 0  # a response came: not sent again


def test_a_stream_closed_without_done_is_an_error(stub_url):
    record = one_request(stub_url, "no-done")
    assert record.finish_reason == "stop" and record.text == " no-done"  # all else looked complete
    assert record.error_type == "no [DONE]" and record.retries == 0


def test_a_stream_without_any_finish_reason_is_an_error(stub_url):
    record = one_request(stub_url, "no-finish")
    assert record.text == " partial" and record.completion_tokens == 1
    assert record.error_type == "no finish_reason" and record.finish_reason is None


def test_a_non_streamed_answer_needs_a_finish_reason_too(stub_url):
    whole = one_request(stub_url, "whole")
    assert whole.error is None and whole.finish_reason == "stop" and whole.text == " whole answer"
    assert whole.completion_tokens == 2
    bare = one_request(stub_url, "whole-no-finish")
    assert bare.error_type == "no finish_reason" and bare.text == " whole answer"


def test_a_level_counts_finish_reasons_and_each_failure_by_type(stub_url):
    prompts = [{"id": f"p{i}", "prompt": p} for i, p in
               enumerate(["one two", "a b c d e", "error-event", "no-done", "no-finish", "three"])]
    level = asyncio.run(run_level("stub", stub_url + "/v1", "stub", prompts, 2, 3, 0.0))
    summary = level.summary()
    assert summary["requests"] == 6 and summary["errors"] == 3
    assert summary["errors_by_type"] == {"error event": 1, "no [DONE]": 1, "no finish_reason": 1}
    assert summary["finish_reasons"] == {"length": 1, "stop": 2}  # served requests only
    assert summary["completion_tokens"] == 2 + 3 + 1  # the failed requests' tokens count in no throughput
    assert {q.prompt_id: q.finish_reason for q in level.requests} == {
        "p0": "stop", "p1": "length", "p2": None, "p3": "stop", "p4": None, "p5": "stop"}
