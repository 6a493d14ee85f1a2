"""Checks every run.json under benchmarks/ against the one schema and writes benchmarks/INDEX.md from them.

    python benchmarks/scripts/index.py            # check, then write benchmarks/INDEX.md
    python benchmarks/scripts/index.py --check    # exit 1 on a run.json that breaks the schema or a stale INDEX.md
    python benchmarks/scripts/index.py --fill     # add what a run.json lacks (kind, question, workloads, figures)
                                                  # from its folder, README title and results.json files, and
                                                  # rewrite each results.json compactly (compact(): same data)

A run is a folder benchmarks/results/KIND/RUN/ (or benchmarks/archive/KIND/RUN/) with a run.json; a run.json
further down is a part of that run with its own command. The schema (benchmarks/README.md says the same):

    kind      str   the machine kind, the folder it lies in: xeon, zen1 ... zen5
    machine   str   the CPU as recorded (model, family, flags)
    commit    str   the commit that ran (null only where nothing recorded it)
    date      str   YYYY-MM-DD, where known
    command   str   what was run, as it was run (a list of str where it took several commands)
    question  str   what the run asks, one sentence
    workloads list  workload names (humaneval, chat, code-edit, a JSONL stem ...)
    figures   list  headline numbers: {workload, clients (null: the library, one request at a time), mode,
                    vs (the baseline), speedup, tok_s, part (the subfolder whose results.json gave it)}
    headline_mode list  optional: the modes / servers among the figures that are what a fresh install does
                    (served `verispec-defaults`, the library's `composite-auto`); the index quotes those
    headline  bool  optional: false keeps a run's figures out of the index's headline table
    note, parts, superseded_by, ...: optional, free

The standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
TREES = ("results", "archive")
KINDS = ("xeon", "zen1", "zen2", "zen3", "zen4", "zen5")
INDEX = BENCHMARKS / "INDEX.md"
REQUIRED = {"kind": str, "machine": str, "command": (str, list), "question": str, "workloads": list, "figures": list}
FIGURE = {"workload": str, "mode": str, "vs": str, "speedup": (int, float)}
PLAIN = ("verispec-plain", "plain", "plain-1", "whole")
DEFAULT_MODES = ("verispec-defaults", "defaults", "defaults-1", "defaults-after", "defaults-head")
LIBRARY_DEFAULT = "composite-auto"  # `make demo`: the library's default drafter with --k auto
CLIENTS = (1, 4, 16)


def runs() -> list[Path]:
    """Every run.json, top-level runs and their parts."""
    return sorted(p for tree in TREES for p in (BENCHMARKS / tree).glob("*/**/run.json")
                  if p.relative_to(BENCHMARKS / tree).parts[0] in KINDS)


def kind_of(path: Path) -> str:
    return path.relative_to(BENCHMARKS).parts[1]


def top_run(path: Path) -> Path:
    """The run folder (benchmarks/TREE/KIND/RUN) a run.json belongs to."""
    return BENCHMARKS.joinpath(*path.relative_to(BENCHMARKS).parts[:3])


def check(path: Path, run) -> list[str]:
    where = path.relative_to(BENCHMARKS).as_posix()
    if not isinstance(run, dict):
        return [f"{where}: not a JSON object"]
    problems = [f"{where}: `{key}` missing or of the wrong type" for key, kind in REQUIRED.items()
                if not isinstance(run.get(key), kind)]
    if run.get("kind") != kind_of(path):
        problems.append(f"{where}: kind {run.get('kind')!r} but it lies under {kind_of(path)}/")
    if not (run.get("commit") is None or isinstance(run.get("commit"), str)):
        problems.append(f"{where}: `commit` not a string")
    if "commit" not in run:
        problems.append(f"{where}: `commit` missing")
    if run.get("date") is not None and not re.fullmatch(r"\d{4}-\d\d-\d\d", str(run["date"])):
        problems.append(f"{where}: `date` not YYYY-MM-DD")
    for number, figure in enumerate(run.get("figures") or []):
        if not isinstance(figure, dict):
            problems.append(f"{where}: figures[{number}] not an object")
            continue
        problems += [f"{where}: figures[{number}].{key} missing or not {kind if isinstance(kind, type) else 'a number'}"
                     for key, kind in FIGURE.items() if not isinstance(figure.get(key), kind)]
        if figure.get("clients") is not None and not isinstance(figure.get("clients"), int):
            problems.append(f"{where}: figures[{number}].clients not an integer or null")
    return problems


# --fill: what can be read off the folder --------------------------------------------------------------------

def workload_name(text) -> str:
    text = str(text or "?")
    return Path(text).stem if "/" in text or text.endswith(".jsonl") else text


def figures_of(results: dict, part: str) -> list[dict]:
    figures = []
    if isinstance(results.get("summaries"), list):  # verispec bench-serve
        workload = workload_name((results.get("meta") or {}).get("workload"))
        first: dict = {}
        for s in results["summaries"]:
            first.setdefault((s["server"], s["concurrency"]), s)  # a level run twice: its first turn
        servers = {server for server, _ in first}
        plain = next((name for name in PLAIN if name in servers), None)
        if plain is None:
            return []
        for (server, clients), s in sorted(first.items(), key=lambda item: (item[0][1], item[0][0])):
            base = first.get((plain, clients))
            if server == plain or not base or not s.get("throughput_tokens_per_second"):
                continue
            tps, base_tps = s["throughput_tokens_per_second"], base.get("throughput_tokens_per_second")
            if base_tps:
                figures.append({"workload": workload, "clients": clients, "mode": server, "vs": plain,
                                "speedup": round(tps / base_tps, 2), "tok_s": round(tps, 2), "part": part})
    elif isinstance(results.get("summary"), list):  # verispec bench
        workload = workload_name(results.get("workload"))
        baselines = results.get("baselines") or {}
        for s in results["summary"]:
            vs = baselines.get(s["mode"]) or results.get("baseline") or "plain"
            if s["mode"] == vs or s.get("speedup_geomean") is None:
                continue
            figures.append({"workload": workload, "clients": None, "mode": s["mode"], "vs": vs,
                            "speedup": round(s["speedup_geomean"], 2),
                            "tok_s": None if s.get("tokens_per_second") is None else round(s["tokens_per_second"], 2),
                            "part": part})
    return figures


def question_of(folder: Path) -> str:
    for name in ("README.md", "report.md"):
        path = folder / name
        if path.exists():
            first = path.read_text().splitlines()[0] if path.read_text().strip() else ""
            if first.startswith("# ") and not first.startswith(("# verispec bench", "# Serving benchmark")):
                return first[2:].strip()
    return ""


def fill(path: Path) -> bool:
    run = json.loads(path.read_text())
    before = json.dumps(run, sort_keys=True)
    completed(path, run)
    if json.dumps(run, sort_keys=True) == before:
        return False
    path.write_text(json.dumps(run, indent=1) + "\n")
    return True


def completed(path: Path, run: dict) -> dict:
    """`run` with what it lacks read off its folder (in place)."""
    folder = path.parent
    run.setdefault("kind", kind_of(path))
    run.setdefault("commit", None)
    if not run.get("question"):
        run["question"] = question_of(folder) or f"TODO: what {folder.name} asks"
    nested = [p.parent for p in folder.rglob("run.json") if p != path]
    files = [p for p in sorted(folder.rglob("results.json")) if not any(n in p.parents or n == p.parent for n in nested)]
    if "figures" not in run:
        run["figures"] = []
        for file in files:
            try:
                results = json.loads(file.read_text())
            except ValueError:
                continue
            if isinstance(results, dict):
                part = file.parent.relative_to(folder).as_posix()
                run["figures"] += figures_of(results, "" if part == "." else part)
    if "workloads" not in run:
        run["workloads"] = sorted({f["workload"] for f in run["figures"]}) or (
            [workload_name(w) for w in run["workloads_"]] if "workloads_" in run else [])
    modes = {f["mode"] for f in run["figures"]}
    if "headline_mode" not in run:
        chosen = [m for m in DEFAULT_MODES if m in modes][:1] + ([LIBRARY_DEFAULT] if LIBRARY_DEFAULT in modes else [])
        if chosen:
            run["headline_mode"] = chosen
    return run


def compact(value, width: int = 5000, indent: int = 0) -> str:
    """JSON laid out as the tools write it (indent 1), except that a list or object whose one-line form is at most
    `width` characters stays on one line: a results.json's per-request and per-prompt records then take a line each,
    and the file about 3/4 of its bytes. json.loads reads back exactly the same value."""
    flat = json.dumps(value, separators=(",", ":"))
    if not isinstance(value, (dict, list)) or not value or len(flat) <= width:
        return flat
    pad = " " * (indent + 1)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(key)}: {compact(item, width, indent + 1)}" for key, item in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if not any(isinstance(item, (dict, list)) for item in value):
        return flat
    return "[\n" + ",\n".join(f"{pad}{compact(item, width, indent + 1)}" for item in value) + "\n" + " " * indent + "]"


def compact_results(path: Path) -> bool:
    """Rewrite a results.json compactly where that changes its text but not its value."""
    text = path.read_text()
    try:
        value = json.loads(text)
    except ValueError:
        return False
    new = compact(value) + "\n"
    if new == text or json.dumps(json.loads(new)) != json.dumps(value):
        return False
    path.write_text(new)
    return True


# the index -------------------------------------------------------------------------------------------------

def rel(path: Path) -> str:
    return path.relative_to(BENCHMARKS).as_posix()


def index(loaded: dict[Path, dict]) -> str:
    tops = {p: r for p, r in loaded.items() if p.parent == top_run(p)}
    lines = ["# How fast is it on my machine kind?", "",
             "Generated by `python benchmarks/scripts/index.py` from every run's run.json (the schema:",
             "[README.md](README.md#runjson)); do not edit by hand. Find your kind with `verispec doctor` or",
             "`python -c \"from verispec.bench.machine import machine_kind; print(machine_kind())\"`.", "",
             "Each cell: the shipped defaults (`verispec serve` with no flags, or `make demo` for the library) against",
             "verispec's own plain decoding on the same machine in the same run, from the newest run that measured it",
             "(its link). The machines are shared; figures move by up to a third between days, so compare within a",
             "run. Every figure per run: `results/<kind>/TABLE.md` (`make tables`).", ""]
    lines += ["| kind | machine | table |", "|---|---|---|"]
    for kind in KINDS:
        machines = sorted({r["machine"] for p, r in tops.items() if r.get("kind") == kind and "results" in p.parts})
        if machines:
            lines.append(f"| [{kind}](#{kind}) | {machines[-1]} | [TABLE.md](results/{kind}/TABLE.md) |")
    for kind in KINDS:
        mine = sorted(((p, r) for p, r in tops.items() if r.get("kind") == kind),
                      key=lambda item: (str(item[1].get("date") or ""), item[0].parent.name), reverse=True)
        if not mine:
            continue
        lines += ["", f"## {kind}", ""]
        best: dict[tuple, tuple] = {}
        for path, run in mine:
            if "archive" in path.parts or run.get("headline") is False:
                continue
            for figure in run["figures"]:
                if figure["mode"] not in (run.get("headline_mode") or []):
                    continue
                key = (figure["workload"], figure["clients"])
                if key not in best:  # newest first
                    best[key] = (figure, path.parent, run)
        if best:
            workloads = sorted({w for w, _ in best}, key=lambda w: (w not in ("humaneval", "chat", "code-edit"), w))
            columns = [None, *CLIENTS]
            lines += ["| workload | library, 1 request | 1 client | 4 clients | 16 clients |",
                      "|---|---|---|---|---|"]
            for workload in workloads:
                cells = []
                for clients in columns:
                    found = best.get((workload, clients))
                    if not found:
                        cells.append("-")
                        continue
                    figure, folder, run = found
                    cells.append(f"**{figure['speedup']:.2f}x** ([{folder.name}]({rel(folder)}/), "
                                 f"{run.get('date') or '?'})")
                lines.append(f"| {workload} | " + " | ".join(cells) + " |")
        else:
            lines.append("No run of the shipped defaults against plain on this kind yet (`make bench`).")
        lines += ["", "Runs, newest first:", "", "| run | question | date | commit |", "|---|---|---|---|"]
        for path, run in mine:
            folder = path.parent
            tag = " (superseded)" if "archive" in path.parts else ""
            question = str(run["question"]).replace("|", "/")
            lines.append(f"| [{folder.name}]({rel(folder)}/){tag} | {question} | {run.get('date') or '?'} | "
                         f"{(run.get('commit') or '?')[:10]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 on a bad run.json or stale index")
    parser.add_argument("--fill", action="store_true",
                        help="add what each run.json lacks, from its folder; rewrite each results.json compactly")
    args = parser.parse_args(argv)
    if args.fill:
        for path in runs():
            if fill(path):
                print(f"filled {rel(path)}")
        for path in sorted({p for run in runs() for p in top_run(run).rglob("results.json")}):
            if compact_results(path):
                print(f"compacted {rel(path)}")
    loaded, problems = {}, []
    for path in runs():
        try:
            loaded[path] = json.loads(path.read_text())
        except ValueError as error:
            problems.append(f"{rel(path)}: {error}")
            continue
        problems += check(path, loaded[path])
        completed(path, loaded[path])  # what an older run.json lacks, for the index only
    for folder in sorted(p for tree in TREES for kind in KINDS for p in (BENCHMARKS / tree / kind).glob("*/")
                         if p.is_dir()):
        if not (folder / "run.json").exists():
            problems.append(f"{rel(folder)}/: no run.json")
    for problem in problems:
        print(problem, file=sys.stderr)
    text = index(loaded)
    if args.check:
        if not INDEX.exists() or INDEX.read_text() != text:
            print("stale: benchmarks/INDEX.md (run: python benchmarks/scripts/index.py)", file=sys.stderr)
            return 1
        return 1 if problems else 0
    INDEX.write_text(text)
    print(f"wrote {rel(INDEX)} ({len(loaded)} run.json files, {len(problems)} problems)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
