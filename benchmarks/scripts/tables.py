"""Writes benchmarks/results/KIND/TABLE.md, one per machine kind, from the results stored there.

    python benchmarks/scripts/tables.py            # `make tables`: every kind
    python benchmarks/scripts/tables.py --check    # exit 1 where a TABLE.md is not what the results give

Each folder under benchmarks/results/KIND/ is a run: its run.json says the commit, date, machine and command
(a "parts" entry gives a subfolder's own commit), and every results.json under it is read whatever its shape:
`verispec bench` (per-mode "summary"), `verispec bench-serve` ("summaries" per server and client count) and
benchmarks/scripts/forward_cost.py ("seconds" per format and row count). Anything else, or a file that cannot
be read, is listed at the bottom of the table instead of stopping the others. The standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

from index import workload_name  # benchmarks/scripts/index.py: a workload's short name

BENCHMARKS = Path(__file__).resolve().parents[1]
RESULTS = BENCHMARKS / "results"
ARCHIVE = BENCHMARKS / "archive"
# bench-serve servers the others are compared with, where a run has them.
OWN_PLAIN = ("verispec-plain", "plain")
PEER_PLAIN = "llama.cpp-plain"
KIND = re.compile(r"xeon|zen\d")  # results/ also holds acceptance-traces/, which is no machine kind


def fmt(value, pattern: str = "{:.2f}", scale: float = 1.0) -> str:
    return "-" if value is None else pattern.format(value * scale)


def link(target: Path, base: Path, text: str) -> str:
    return f"[{text}]({target.relative_to(base).as_posix()})"


def read_run(folder: Path, notes: list[str]) -> dict:
    try:
        run = json.loads((folder / "run.json").read_text())
        if not isinstance(run, dict):
            raise ValueError("not a JSON object")
        return run
    except FileNotFoundError:
        problem = "missing"
    except (OSError, ValueError) as error:
        problem = f"{error.__class__.__name__}: {error}"
    notes.append(f"{folder.name}/run.json: {problem}; the commit is taken from its results where they record one")
    return {}


def commit_of(run: dict, part: str, results: dict) -> str:
    first = part.split("/")[0] if part else ""
    parts = run.get("parts") if isinstance(run.get("parts"), dict) else {}
    if isinstance(parts.get(first), dict) and parts[first].get("commit"):
        return parts[first]["commit"]
    meta = results.get("meta") if isinstance(results.get("meta"), dict) else results
    return run.get("commit") or meta.get("commit") or "?"


def library_rows(results: dict, where: str, commit: str) -> list[str]:
    """`verispec bench`: one row per mode, speedup against the mode's baseline (plain unless said)."""
    prompts = results.get("prompts")  # the raw per-prompt runs; older files may hold the count
    workload = f"{workload_name(results.get('workload'))} ({len(prompts) if isinstance(prompts, list) else prompts})"
    baselines = results.get("baselines") or {}
    rows = []
    for s in results["summary"]:
        baseline = baselines.get(s["mode"]) or results.get("baseline") or "plain"
        ci = s.get("speedup_ci95")
        speedup = fmt(s.get("speedup_geomean"), "{:.2f}x")
        if ci and s["mode"] != baseline:
            speedup += f" [{ci[0]:.2f}, {ci[1]:.2f}]"
        other = []
        if s.get("pass_at_1") is not None:
            other.append(f"pass@1 {s['pass_at_1']:.1%}")
        if s.get("schema_valid") is not None:
            other.append(f"schema-valid {s['schema_valid']:.0%}")
        rows.append(" | ".join([
            where, workload, s["mode"], fmt(s.get("tokens_per_second")), speedup, baseline,
            fmt(s.get("mean_tokens_per_target_forward")), fmt(s.get("acceptance_rate"), "{:.0f}%", 100),
            fmt(s.get("identical_to_baseline"), "{:.0f}%", 100), ", ".join(other) or "-", commit,
        ]))
    return rows


def served_rows(results: dict, where: str, commit: str) -> list[str]:
    """`verispec bench-serve`: one row per server and client count (a level run twice gives two turns)."""
    summaries = results["summaries"]
    workload = workload_name(results.get("meta", {}).get("workload"))
    turn: Counter = Counter()
    by_turn = {}
    keyed = []
    for s in summaries:
        key = (s["server"], s["concurrency"])
        turn[key] += 1
        by_turn[(*key, turn[key])] = s
        keyed.append((turn[key], s))
    own = next((name for name in OWN_PLAIN if any(s["server"] == name for s in summaries)), None)
    order = list(results.get("meta", {}).get("servers") or {})  # as the command named them (turns rotate)
    keyed.sort(key=lambda item: (item[1]["concurrency"], item[0],
                                 order.index(item[1]["server"]) if item[1]["server"] in order else len(order)))
    rows = []
    for number, s in keyed:
        tps = s.get("throughput_tokens_per_second")

        def against(name):
            base = by_turn.get((name, s["concurrency"], number)) if name else None
            base_tps = base.get("throughput_tokens_per_second") if base else None
            return "-" if not (tps and base_tps) else f"{tps / base_tps:.2f}x"

        rows.append(" | ".join([
            where, workload, str(s["concurrency"]), s["server"], fmt(tps), against(own), against(PEER_PLAIN),
            fmt(s.get("ttft_p50")), fmt(s.get("per_token_latency_p50"), "{:.0f}", 1000),
            fmt(s.get("tokens_per_target_forward")), fmt(s.get("acceptance_rate"), "{:.0f}%", 100),
            f"{s.get('errors', '?')} / {s.get('requests', '?')}", commit,
        ]))
    return rows


def forward_rows(results: dict, where: str, commit: str) -> list[str]:
    """forward_cost.py: median ms of one target forward per format at 1-16 new tokens (warm-up rounds dropped)."""
    rounds = results.get("rounds")
    seconds: dict[str, dict[int, float]] = {}
    for key, values in results["seconds"].items():
        name, _, tokens = key.rpartition("/")
        kept = values[len(values) - rounds:] if rounds and len(values) > rounds else values
        seconds.setdefault(name, {})[int(tokens)] = statistics.median(kept)
    rows = []
    for name, by_tokens in seconds.items():
        info = (results.get("formats") or {}).get(name) or {}
        label = f"{info.get('format', name)} ({info.get('dtype', '?')})"
        ms = [fmt(by_tokens.get(n), "{:.1f}", 1000) for n in (1, 2, 4, 8, 16)]
        ratio = f"{by_tokens[8] / by_tokens[1]:.2f}x" if 1 in by_tokens and 8 in by_tokens else "-"
        rows.append(" | ".join([where, label, *ms, ratio, commit]))
    return rows


def admission_rows(results: dict, where: str, commit: str) -> list[str]:
    """long_prompt_admission.py: the streams' p95 ms per token, steady and while a long prompt goes in (medians)."""
    by_mode: dict[str, list[dict]] = {}
    for run in results["runs"]:
        by_mode.setdefault(run["mode"], []).append(run)
    rows = []
    for mode, runs in by_mode.items():
        median = {key: statistics.median(r[key] for r in runs) for key in ("steady_p95", "during_p95", "long_ttft")}
        rows.append(" | ".join([
            where, mode, str(runs[0].get("long_prompt_tokens", "?")), fmt(median["steady_p95"], "{:.1f}", 1000),
            fmt(median["during_p95"], "{:,.1f}", 1000), f"{median['during_p95'] / median['steady_p95']:.2f}x",
            fmt(median["long_ttft"], "{:.1f}"), str(len(runs)), commit,
        ]))
    return rows


SHAPES = [  # (test, section, rows)
    (lambda r: isinstance(r.get("summary"), list), "library", library_rows),
    (lambda r: isinstance(r.get("summaries"), list), "served", served_rows),
    (lambda r: isinstance(r.get("seconds"), dict), "forward", forward_rows),
    (lambda r: isinstance(r.get("runs"), list), "admission", admission_rows),
]
HEADERS = {
    "served": ("Served: `verispec bench-serve`", "tok/s over all clients; `x plain`: against verispec's plain server "
               "(`verispec-plain` or `plain`) at the same client count and turn; `x llama.cpp`: against "
               "`llama.cpp-plain`; ms/token and TTFT are medians over requests.",
               "| run | workload | clients | server | tok/s | x plain | x llama.cpp | TTFT p50 s | ms/token p50 "
               "| tokens / target forward | acceptance | errors / requests | commit |"),
    "library": ("Library: `verispec bench`", "One request at a time; speedup: geometric mean of per-prompt tok/s "
                "ratios against the `vs` mode, with its 95% bootstrap interval; `same text`: outputs equal to that "
                "mode's.",
                "| run | workload (prompts) | mode | tok/s | speedup [95% CI] | vs | tokens / target forward "
                "| acceptance | same text | other | commit |"),
    "forward": ("One target forward: `benchmarks/scripts/forward_cost.py`", "Median ms at 1 / 2 / 4 / 8 / 16 new "
                "tokens after a 512-token context.",
                "| run | format | 1 | 2 | 4 | 8 | 16 | 8 / 1 | commit |"),
    "admission": ("A long prompt admitted while streams decode: `benchmarks/scripts/long_prompt_admission.py`",
                  "The decoding streams' p95 ms per token, steady and while the long prompt goes in, and that prompt's "
                  "time to first token; medians over the runs of each mode.",
                  "| run | prefill | prompt tokens | p95 steady ms | p95 during ms | ratio | its TTFT s | runs "
                  "| commit |"),
}


def table(kind_dir: Path) -> str:
    notes: list[str] = []
    sections: dict[str, list[str]] = {name: [] for name in HEADERS}
    runs = []
    for folder in sorted(p for p in kind_dir.iterdir() if p.is_dir()):
        run = read_run(folder, notes)
        runs.append((str(run.get("date", "")), folder, run))
    runs.sort(key=lambda item: (item[0], item[1].name), reverse=True)  # newest first
    for _, folder, run in runs:
        files = sorted(folder.rglob("results.json"))
        if not files:
            notes.append(f"{link(folder, kind_dir, folder.name + '/')}: no results.json")
        for path in files:
            part = path.parent.relative_to(folder).as_posix()
            part = "" if part == "." else part
            target = next((path.parent / name for name in ("report.md", "README.md") if (path.parent / name).exists()),
                          path.parent)
            where = link(target, kind_dir, f"{folder.name}/{part}" if part else folder.name)
            try:
                results = json.loads(path.read_text())
                if not isinstance(results, dict):
                    raise ValueError("not a JSON object")
                shape = next(((name, rows) for test, name, rows in SHAPES if test(results)), None)
                if shape is None:
                    notes.append(f"{where}: not tabulated (a results.json with keys {', '.join(sorted(results)[:6])})")
                    continue
                sections[shape[0]] += shape[1](results, where, commit_of(run, part, results))
            except Exception as error:  # one unreadable file costs its rows, never the table
                notes.append(f"{where}: skipped ({error.__class__.__name__}: {error})")
    machines = sorted({str(run.get("machine")) for _, _, run in runs if run.get("machine")})
    lines = [f"# Current results: {kind_dir.name}", "",
             "Generated by `make tables` (benchmarks/scripts/tables.py) from each run's run.json and results.json;",
             "do not edit by hand. Compare figures within one run: the machines are shared and their speed moves",
             "between days. Each run's README or report.md says what was measured and why.", "", "Machines:", ""]
    lines += [f"- {machine}" for machine in machines] or ["- (no run.json says)"]
    for name, (title, explanation, header) in HEADERS.items():
        if not sections[name]:
            continue
        columns = header.count("|") - 1
        lines += ["", f"## {title}", "", explanation, "", header, "|" + "---|" * columns]
        lines += [f"| {row} |" for row in sections[name]]
    archived = ARCHIVE / kind_dir.name
    if archived.is_dir():
        old = sorted(p for p in archived.iterdir() if p.is_dir())
        if old:
            lines += ["", "## Superseded runs", "",
                      f"Kept in [benchmarks/archive/{kind_dir.name}/](../../archive/{kind_dir.name}/), "
                      "not in the tables above:", ""]
            for folder in old:
                try:
                    later = json.loads((folder / "run.json").read_text()).get("superseded_by")
                except (OSError, ValueError, AttributeError):
                    later = None
                lines.append(f"- [{folder.name}](../../archive/{kind_dir.name}/{folder.name}/)"
                             + (f": superseded by `{later}`" if later else ""))
    if notes:
        lines += ["", "## Not in the tables", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 where a TABLE.md is stale")
    args = parser.parse_args(argv)
    stale = []
    for kind_dir in sorted(p for p in RESULTS.iterdir() if p.is_dir() and KIND.fullmatch(p.name)):
        text, path = table(kind_dir), kind_dir / "TABLE.md"
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(BENCHMARKS.parent)}")
    for path in stale:
        print(f"stale: {path.relative_to(BENCHMARKS.parent)} (run: make tables)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
