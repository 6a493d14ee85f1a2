"""`verispec bench-serve`: load-test running OpenAI-compatible servers at several concurrency levels.

Each level keeps `concurrency` streaming clients busy until every prompt of the workload was
served once. Servers are measured side by side: for each level the servers take turns (order
rotated per level), so a noisy machine slows all of them alike. Works against any server that
speaks the OpenAI streaming API (verispec serve, vLLM, llama.cpp's server...); `--start` has
bench-serve start a server fresh for each of its turns (see `servers.py`).

No request is lost to a peer's connection handling: a request that fails before any byte of the
response arrived (a keep-alive connection the server had already closed, a refused connect) is
sent again on a fresh connection, at most `RETRIES` times. Every error that remains is recorded
with its type and counted per server.

No failure passes for a short answer either: a stream that carries an error event (`data: {"error":
{...}}`, as verispec and OpenAI send one), closes before `data: [DONE]`, or reaches it without any
chunk giving a `finish_reason` is an error of its own type ("error event", "no [DONE]", "no
finish_reason"), as is a non-streamed JSON answer without a `finish_reason`. Each request's finish
reason is kept, and every level counts them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from verispec.bench.machine import git_commit, machine_description, machine_kind
from verispec.bench.report import format_or_dash
from verispec.bench.servers import (
    ServerSpec, ServerUnavailable, StartedServer, client_headers, counter_delta, model_of, spec_counters,
)
from verispec.bench.workloads import load_workload

RETRIES = 3  # sends of one request beyond the first, each on a fresh connection


@dataclass
class RequestRecord:
    prompt_id: str
    started: float  # seconds since the level started
    first_token: float | None  # seconds from request start to the first text chunk
    finished: float  # seconds from request start to the end of the stream
    chunk_times: list[float] = field(default_factory=list)  # seconds from request start, per text chunk
    completion_tokens: int = 0
    text: str = ""
    speculative: dict | None = None  # the server's own stats, when it reports them
    error: str | None = None
    error_type: str | None = None  # e.g. "RemoteProtocolError", "HTTP 500", "error event", "no [DONE]"
    finish_reason: str | None = None  # the server's, e.g. "length" or "stop"; None when none came
    retries: int = 0  # sends again on a fresh connection after failing before any response byte


@dataclass
class LevelResult:
    server: str
    concurrency: int
    wall_seconds: float
    requests: list[RequestRecord]
    startup_seconds: float | None = None  # servers started by bench-serve: from start to serving
    server_counters: dict | None = None  # the server's speculative counters over this turn (/metrics)

    def summary(self) -> dict:
        ok = [r for r in self.requests if r.error is None]
        tokens = sum(r.completion_tokens for r in ok)
        ttft = [r.first_token for r in ok if r.first_token is not None]
        per_token = [
            (r.finished - r.first_token) / (r.completion_tokens - 1)
            for r in ok if r.first_token is not None and r.completion_tokens > 1
        ]
        spec = [r.speculative for r in ok if r.speculative]
        drafted = sum(s.get("drafted_tokens", 0) for s in spec)
        accepted = sum(s.get("accepted_tokens", 0) for s in spec)
        forwards = sum(s.get("target_forwards", 0) for s in spec)
        tokens_per_forward = (
            sum(r.completion_tokens for r in ok if r.speculative) / forwards if forwards else None
        )
        counters = self.server_counters or {}
        if not spec and counters.get("draft_tokens"):  # peers: from their own /metrics over the turn
            drafted, accepted = counters["draft_tokens"], counters.get("accepted_tokens", 0.0)
            # every target forward yields one token of its own plus the drafts it accepted
            tokens_per_forward = tokens / (tokens - accepted) if tokens > accepted else None
        errors_by_type = dict(Counter(r.error_type or "error" for r in self.requests if r.error is not None))
        # served requests only, so finish reasons and errors add up to the requests
        finish_reasons = dict(sorted(Counter(r.finish_reason for r in ok if r.finish_reason is not None).items()))
        return {
            "server": self.server,
            "concurrency": self.concurrency,
            "requests": len(self.requests),
            "errors": len(self.requests) - len(ok),
            "errors_by_type": errors_by_type,
            "finish_reasons": finish_reasons,
            "retries": sum(r.retries for r in self.requests),
            "startup_seconds": self.startup_seconds,
            "completion_tokens": tokens,
            "wall_seconds": self.wall_seconds,
            "throughput_tokens_per_second": tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0,
            "ttft_p50": _quantile(ttft, 0.5),
            "ttft_p95": _quantile(ttft, 0.95),
            "per_token_latency_p50": _quantile(per_token, 0.5),
            "per_token_latency_p95": _quantile(per_token, 0.95),
            "request_latency_p50": _quantile([r.finished for r in ok], 0.5),
            "acceptance_rate": accepted / drafted if drafted else None,
            "tokens_per_target_forward": tokens_per_forward,
        }


def _quantile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, 100 * q)) if values else None


async def _one_request(
    client: httpx.AsyncClient, base_url: str, model: str, item: dict, max_tokens: int, temperature: float,
    level_start: float, retries: int = RETRIES,
) -> RequestRecord:
    chat = "messages" in item
    body = {
        "model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update({"messages": item["messages"]} if chat else {"prompt": item["prompt"]})
    url = base_url.rstrip("/") + ("/chat/completions" if chat else "/completions")
    start = time.perf_counter()
    record = RequestRecord(str(item["id"]), start - level_start, None, 0.0)
    responded = await _stream_into(record, client, url, body, chat, start)
    while record.error is not None and not responded and record.retries < retries:
        # Nothing came back (a keep-alive connection the server had closed, a refused connect): send again, fresh.
        record.retries += 1
        record.error = record.error_type = None
        async with httpx.AsyncClient(
            timeout=client.timeout, limits=httpx.Limits(max_keepalive_connections=0), headers=client.headers
        ) as fresh:
            responded = await _stream_into(record, fresh, url, body, chat, start)
    record.finished = time.perf_counter() - start
    return record


async def _stream_into(
    record: RequestRecord, client: httpx.AsyncClient, url: str, body: dict, chat: bool, start: float
) -> bool:
    """Send one request and read its stream into `record`; True once any byte of a response arrived.

    A response that ends without proof of having finished is an error: an error event in the stream,
    no `data: [DONE]` before the stream closed, or no `finish_reason` in any chunk.
    """
    responded = False
    try:
        async with client.stream("POST", url, json=body) as response:
            responded = True
            if response.status_code != 200:
                record.error_type = f"HTTP {response.status_code}"
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                return responded
            if response.headers.get("content-type", "").startswith("application/json"):  # answered whole
                _read_whole(record, json.loads(await response.aread()), chat, time.perf_counter() - start)
                return responded
            done = False
            event_error: str | None = None
            async for line in response.aiter_lines():
                if line.startswith("error:") or line.strip() == "event: error":  # an SSE error event (llama.cpp)
                    event_error = event_error or line.partition(":")[2].strip() or "error event"
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[len("data: "):])
                message = _error_message(chunk)
                if message is not None:
                    event_error = event_error or message
                    continue
                for choice in chunk.get("choices") or []:
                    piece = choice.get("text") if not chat else (choice.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter() - start
                        record.chunk_times.append(now)
                        record.first_token = record.first_token if record.first_token is not None else now
                        record.text += piece
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                if chunk.get("usage"):
                    record.completion_tokens = chunk["usage"].get("completion_tokens", 0)
                if chunk.get("speculative"):
                    record.speculative = chunk["speculative"]
        if not record.completion_tokens:  # a server that reports no usage: one token per text chunk
            record.completion_tokens = len(record.chunk_times)
        if event_error is not None:
            record.error_type, record.error = "error event", f"error event: {event_error}"
        elif not done:
            record.error_type, record.error = "no [DONE]", "the stream ended without data: [DONE]"
        elif record.finish_reason is None:
            record.error_type, record.error = "no finish_reason", "no chunk of the stream gave a finish_reason"
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        record.error_type = type(error).__name__
        record.error = f"{type(error).__name__}: {error}"
    return responded


def _error_message(payload: dict) -> str | None:
    """The message of an error payload: OpenAI's and verispec's {"error": {...}} (or {"error": "..."}),
    or the flat {"object": "error", "message": ...} of some peers; None for anything else."""
    error = payload.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or json.dumps(error))
    if error:
        return str(error)
    if payload.get("object") == "error":
        return str(payload.get("message") or json.dumps(payload))
    return None


def _read_whole(record: RequestRecord, answer: dict, chat: bool, now: float) -> None:
    """A non-streamed answer: its text as one chunk; an error without a finish_reason, as in a stream."""
    message = _error_message(answer)
    if message is not None:
        record.error_type, record.error = "error event", f"error event: {message}"
        return
    for choice in answer.get("choices") or []:
        piece = choice.get("text") if not chat else (choice.get("message") or {}).get("content")
        if piece:
            record.chunk_times.append(now)
            record.first_token = record.first_token if record.first_token is not None else now
            record.text += piece
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    record.completion_tokens = (answer.get("usage") or {}).get("completion_tokens") or len(record.chunk_times)
    if answer.get("speculative"):
        record.speculative = answer["speculative"]
    if record.finish_reason is None:
        record.error_type, record.error = "no finish_reason", "the answer gave no finish_reason"


async def run_level(
    server: str, base_url: str, model: str, prompts: list[dict], concurrency: int, max_tokens: int, temperature: float
) -> LevelResult:
    """Serve every prompt once with `concurrency` clients streaming at the same time."""
    pending = list(prompts)
    records: list[RequestRecord] = []
    level_start = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=30.0), limits=limits, headers=client_headers()
    ) as client:

        async def client_loop() -> None:
            while pending:
                item = pending.pop(0)
                records.append(await _one_request(client, base_url, model, item, max_tokens, temperature, level_start))

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return LevelResult(server, concurrency, time.perf_counter() - level_start, records)


def _prompts_for_level(prompts: list[dict], count: int) -> list[dict]:
    """`count` requests, cycling through the workload."""
    return [prompts[i % len(prompts)] for i in range(count)]


def _requests_per_level(args: argparse.Namespace, levels: list[int]) -> list[int]:
    if args.requests is None:
        return [concurrency * args.requests_per_client for concurrency in levels]
    counts = [int(c) for c in args.requests.split(",") if c.strip()]
    if len(counts) == 1:
        counts *= len(levels)
    if len(counts) != len(levels) or min(counts) < 1:
        raise ValueError(f"--requests takes one positive count, or one per --concurrency level, got {args.requests!r}")
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server", action="append", required=True, metavar="NAME=URL",
        help="a server to measure, e.g. spec=http://127.0.0.1:8000/v1 (repeat to compare servers side by side)",
    )
    parser.add_argument(
        "--start", action="append", default=[], metavar="NAME=COMMAND",
        help="a shell command that starts server NAME: run fresh for each of its turns and stopped after it, "
        "so servers that do not fit in memory together still take turns; one that exits before serving is "
        "skipped with its last output line as the reason",
    )
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds a started server has to answer")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models)")
    parser.add_argument("--workload", default="humaneval", help="humaneval, code-edit, chat, or a JSONL file")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of the workload")
    parser.add_argument("--concurrency", default="1,4,16", help="comma list of concurrent clients")
    parser.add_argument("--requests-per-client", type=int, default=2, help="requests per client at each level")
    parser.add_argument(
        "--requests", default=None, metavar="N[,N...]",
        help="requests per level instead: one count, or one per --concurrency level (e.g. 4,8)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured short requests before each turn")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out", type=Path, default=Path("bench-results/serve"))


def _parse_servers(values: list[str], starts: list[str]) -> list[ServerSpec]:
    urls: dict[str, str] = {}
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--server takes NAME=URL with an http(s) URL, got {value!r}")
        if name in urls:
            raise ValueError(f"--server {name!r} is given twice; each server needs its own name")
        urls[name] = url
    commands: dict[str, str] = {}
    for value in starts:
        name, sep, command = value.partition("=")
        if not sep or not command.strip():
            raise ValueError(f"--start takes NAME=COMMAND, got {value!r}")
        if name not in urls:
            raise ValueError(f"--start names {name!r}, which no --server NAME=URL gives")
        commands[name] = command
    return [ServerSpec(name, url, commands.get(name)) for name, url in urls.items()]


# Not from any workload: a server with a prefix cache (llama.cpp, vLLM) must not get a measured prompt warm.
WARMUP_ITEM = {"id": "warmup", "prompt": "Write a haiku about warm-up laps."}


def _warm_up(url: str, model: str, count: int) -> None:
    """Unmeasured requests, so no server's first (compiling, allocating) request lands in its figures."""
    for _ in range(count):
        asyncio.run(run_level("warmup", url, model, [WARMUP_ITEM], 1, 8, 0.0))


def run_bench_serve(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from verispec.terminal import print_table

    console = Console(stderr=True)
    servers = _parse_servers(args.server, args.start)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency takes positive integers, got {args.concurrency!r}")
    if args.requests_per_client < 1:
        raise ValueError(f"--requests-per-client must be >= 1, got {args.requests_per_client}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    counts = _requests_per_level(args, levels)
    prompts = load_workload(args.workload, args.limit)
    # Servers already running must answer now: a typo in a URL fails before any measuring.
    models = {s.name: args.model or model_of(s.url) for s in servers if s.start_command is None}
    skipped: dict[str, str] = {}
    results: list[LevelResult] = []
    for index, (concurrency, count) in enumerate(zip(levels, counts)):
        order = servers[index % len(servers):] + servers[: index % len(servers)]  # rotate who goes first
        for spec in order:
            if spec.name in skipped:
                continue
            batch = _prompts_for_level(prompts, count)
            if spec.start_command:
                console.print(f"[bold]{spec.name}[/bold]: starting ...")
            try:
                started = StartedServer(spec, args.out / "logs" / f"{spec.name}.log", args.start_timeout)
            except ServerUnavailable as why:
                skipped[spec.name] = str(why)
                console.print(f"[bold]{spec.name}[/bold]: skipped: {why}")
                continue
            try:
                model = models.get(spec.name) or args.model or model_of(spec.url)
                _warm_up(spec.url, model, args.warmup)
                console.print(f"[bold]{spec.name}[/bold]: {len(batch)} requests, {concurrency} concurrent clients ...")
                before = spec_counters(spec.root)
                level = asyncio.run(run_level(spec.name, spec.url, model, batch, concurrency, args.max_tokens, args.temperature))
                level.server_counters = counter_delta(before, spec_counters(spec.root))
                level.startup_seconds = started.startup_seconds
            finally:
                started.stop()
            results.append(level)
            s = level.summary()
            console.print(
                f"  {s['throughput_tokens_per_second']:.2f} tok/s, TTFT p50 {s['ttft_p50'] or 0:.2f} s, "
                f"errors {s['errors']}" + (f" {s['errors_by_type']}" if s["errors"] else "")
                + f", finished {_finish_reasons(s) or 'none'}"
                + (f", retried {s['retries']}" if s["retries"] else "")
            )
    if not results:
        raise RuntimeError("no server could be measured: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    summaries = [r.summary() for r in results]
    measured = [spec.name for spec in servers if spec.name not in skipped]
    if args.temperature == 0:
        _add_agreement(summaries, results, measured[0])
    _write(args, argv, servers, measured, summaries, results, skipped)
    table = Table(title=f"serving: {args.workload}, {args.max_tokens} tokens")
    for column in TABLE_COLUMNS:
        table.add_column(column)
    rows = [_row(s) for s in summaries]
    for row in rows:
        table.add_row(*row)
    narrow = [[cell for column, cell in zip(TABLE_COLUMNS, row) if column in NARROW_COLUMNS] for row in rows]
    print_table(console, table, list(NARROW_COLUMNS), narrow)
    for name, why in skipped.items():
        console.print(f"{name}: skipped: {why}")
    console.print(f"results in {args.out}/")
    return 0 if all(s["errors"] == 0 for s in summaries) else 1


def _add_agreement(summaries: list[dict], results: list[LevelResult], baseline: str) -> None:
    """Greedy runs: the fraction of requests whose text equals the baseline server's for the same prompt."""
    reference = {
        (r.concurrency, q.prompt_id): q.text for r in results if r.server == baseline for q in r.requests if not q.error
    }
    for summary, result in zip(summaries, results):
        pairs = [(q.text, reference.get((result.concurrency, q.prompt_id))) for q in result.requests if not q.error]
        pairs = [(text, ref) for text, ref in pairs if ref is not None]
        summary[f"same_text_as_{baseline}"] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def _clients(count: int) -> str:
    return f"{count} client" + ("s" if count != 1 else "")


def _finish_reasons(s: dict) -> str:
    """A level's finish reasons as counts, e.g. "7 length, 1 stop" ("" when none)."""
    return ", ".join(f"{count} {reason}" for reason, count in (s.get("finish_reasons") or {}).items())


TABLE_COLUMNS = ("server", "clients", "tok/s", "TTFT p50", "TTFT p95", "ms/token p50", "ms/token p95", "accept",
                 "tok/fwd", "finished", "errors")
# what fits 80 columns: the p95s, tokens per forward and finish reasons stay in the wide table and report.md;
# errors come last, where a long list of their kinds can be cut (each level's line above gives them whole)
NARROW_COLUMNS = ("server", "clients", "tok/s", "TTFT p50", "ms/token p50", "accept", "errors")


def _row(s: dict) -> list[str]:
    """A level's row of the table, in TABLE_COLUMNS order."""
    ms = lambda v: None if v is None else v * 1000  # noqa: E731
    return [
        s["server"], str(s["concurrency"]), format_or_dash(s["throughput_tokens_per_second"], "{:.2f}"),
        format_or_dash(s["ttft_p50"], "{:.2f}"), format_or_dash(s["ttft_p95"], "{:.2f}"),
        format_or_dash(ms(s["per_token_latency_p50"]), "{:.0f}"),
        format_or_dash(ms(s["per_token_latency_p95"]), "{:.0f}"),
        format_or_dash(s["acceptance_rate"], "{:.2f}"), format_or_dash(s["tokens_per_target_forward"], "{:.2f}"),
        _finish_reasons(s) or "-",
        str(s["errors"]) + "".join(f" ({count} {kind})" for kind, count in s["errors_by_type"].items()),
    ]


def _write(
    args, argv, servers: list[ServerSpec], names: list[str], summaries: list[dict], results: list[LevelResult],
    skipped: dict[str, str],
) -> None:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    command = "verispec bench-serve " + shlex.join(argv) if argv is not None else None
    meta = {"command": command, "machine": machine_description(), "servers": {s.name: s.url for s in servers},
            "started_with": {s.name: s.start_command for s in servers if s.start_command}, "skipped": skipped,
            "workload": args.workload, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "commit": git_commit(), "machine_kind": machine_kind()}  # the client's checkout; servers may differ
    raw = [{"server": r.server, "concurrency": r.concurrency, "wall_seconds": r.wall_seconds,
            "startup_seconds": r.startup_seconds, "server_counters": r.server_counters,
            "requests": [asdict(q) for q in r.requests]} for r in results]
    (out / "results.json").write_text(json.dumps({"meta": meta, "summaries": summaries, "raw": raw}, indent=1))
    lines = [f"# Serving benchmark: {args.workload}", "", f"Command: `{command}`", "",
             "| server | clients | tok/s | TTFT p50 s | TTFT p95 s | ms/token p50 | ms/token p95 | acceptance "
             "| tok/forward | finished | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(_row(s)) + " |" for s in summaries]
    lines += ["", "Acceptance and tokens per forward: verispec's from each response's `speculative` stats; "
              "peers' from their own /metrics over the turn (`spec_decode_*` counters: accepted / drafted "
              "tokens, and completion tokens / (completion tokens - accepted), as each target forward "
              "yields one token of its own).",
              "", "Finished: the served requests' finish reasons, counted. A stream that carried an error event, "
              "closed before `data: [DONE]`, or reached it without a `finish_reason` is an error of that type "
              "(\"error event\", \"no [DONE]\", \"no finish_reason\") and counts in no figure above."]
    retried = sum(s["retries"] for s in summaries)
    if retried:
        lines += ["", f"Requests sent again on a fresh connection after failing before any response byte: {retried}."]
    if skipped:
        lines += ["", "Not measured:", ""] + [f"- {name}: {why}" for name, why in skipped.items()]
    if meta["started_with"]:
        lines += ["", "Servers started by bench-serve for each turn (startup seconds per turn in results.json):", ""]
        lines += [f"- {name}: `{command_line}`" for name, command_line in meta["started_with"].items()]
    if len(names) > 1:
        lines += ["", f"Throughput relative to `{names[0]}` at the same concurrency:", ""]
        base = {s["concurrency"]: s["throughput_tokens_per_second"] for s in summaries if s["server"] == names[0]}
        for s in summaries:
            if s["server"] != names[0] and base.get(s["concurrency"]):
                lines.append(f"- {s['server']} at {_clients(s['concurrency'])}: "
                             f"{s['throughput_tokens_per_second'] / base[s['concurrency']]:.2f}x")
    agreement = f"same_text_as_{names[0]}"
    if len(names) > 1 and any(s.get(agreement) is not None for s in summaries):
        lines += ["", f"Greedy outputs identical to `{names[0]}`'s for the same prompt:", ""]
        lines += [f"- {s['server']} at {_clients(s['concurrency'])}: {s[agreement]:.0%}"
                  for s in summaries if s["server"] != names[0] and s.get(agreement) is not None]
    lines += ["", "Machine: " + json.dumps(meta["machine"]), ""]
    (out / "report.md").write_text("\n".join(lines))
    _plot(out, names, summaries)


def _plot(out: Path, names: list[str], summaries: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name in names:
        rows = sorted((s for s in summaries if s["server"] == name), key=lambda s: s["concurrency"])
        clients = [s["concurrency"] for s in rows]
        left.plot(clients, [s["throughput_tokens_per_second"] for s in rows], marker="o", label=name)
        right.plot(clients, [(s["per_token_latency_p50"] or 0) * 1000 for s in rows], marker="o", label=name)
    levels = sorted({s["concurrency"] for s in summaries})
    left.set(xlabel="concurrent clients", ylabel="tokens / s (all clients)", title="throughput", xscale="log")
    right.set(xlabel="concurrent clients", ylabel="ms per token (p50)", title="per-token latency", xscale="log")
    for axes in (left, right):
        axes.set_xticks(levels, [str(level) for level in levels])
        axes.minorticks_off()
    left.legend()
    fig.tight_layout()
    fig.savefig(out / "serving.png", dpi=120)
    plt.close(fig)
