"""What a long prompt's admission does to the streams already decoding: chunked prefill on and off.

    .venv/bin/python benchmarks/scripts/long_prompt_admission.py --out benchmarks/results/KIND/chunked-prefill/admission

`--streams` requests (HumanEval prompts, greedy) decode in one scheduler; once they are in steady
state a prompt of about `--long-tokens` tokens arrives. Per stream, each event's time since the
previous one over its tokens is a per-token latency: "steady" before the long prompt arrives,
"during" from its arrival to its first token. Each mode runs in a process of its own (a scheduler
keeps its model thread), modes alternate for `--rounds` rounds, and the medians are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

MODES = ("chunked", "whole", "own-forwards")
# own-forwards: chunked prefill as it was before the chunks rode in the decoding step's forward (a forward of their own).


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    """One scheduler, streams then the long prompt; per-token latencies split at its arrival."""
    from verispec.bench.workloads import load_workload
    from verispec.engine import GenerationConfig
    from verispec.serving.scheduler import SchedulerLimits, build_scheduler, start_in_model_thread

    limits = SchedulerLimits(max_batch_size=args.streams + 1, max_context=args.long_tokens + 512, prefix_cache_bytes=0)
    draft = draft_used(args)
    scheduler = start_in_model_thread(
        lambda: build_scheduler(args.target, draft, args.drafter, limits=limits, chunked_prefill=mode != "whole"),
        args.threads,
    )
    if mode == "own-forwards":
        scheduler.packs_prefill = False
    target = scheduler.target
    prompts = [target.apply_chat_template(p["messages"][0]["content"]) if "messages" in p else p["prompt"]
               for p in load_workload("humaneval", args.streams)]
    policy = (Path(__file__).parents[1] / "workloads" / "support-policy.txt").read_text()
    long_ids = (target.encode(policy) * (args.long_tokens // 900 + 2))[: args.long_tokens]
    arrivals: list[list[tuple[float, int]]] = [[] for _ in prompts]

    def follow(index: int, handle) -> None:
        for event in handle.iter_events():
            if event.token_ids:
                arrivals[index].append((time.perf_counter(), len(event.token_ids)))

    config = GenerationConfig(max_new_tokens=args.stream_tokens, eos_token_ids=())  # streams run their length
    threads = [threading.Thread(target=follow, args=(i, scheduler.submit(target.encode(p), config)))
               for i, p in enumerate(prompts)]
    for thread in threads:
        thread.start()
    while min(len(a) for a in arrivals) < args.warmup_events:  # every stream decoding, past its first tokens
        time.sleep(0.01)
    submitted = time.perf_counter()
    long_events = list(scheduler.submit(long_ids, GenerationConfig(max_new_tokens=4)).iter_events())
    first_token = submitted + long_events[-1].stats.time_to_first_token
    for thread in threads:
        thread.join()
    scheduler.stop()

    settled = max(stream[3][0] for stream in arrivals)  # every stream past its first tokens (and the others' prompts)
    steady, during = [], []
    for stream in arrivals:
        for (before, _), (now, tokens) in zip(stream, stream[1:]):
            latency = (now - before) / tokens
            if settled <= before and now <= submitted:
                steady.append(latency)
            elif before < first_token:  # the interval overlaps the long prompt's admission
                during.append(latency)
    return {
        "mode": mode, "long_prompt_tokens": len(long_ids), "long_ttft": first_token - submitted,
        "steady_p50": percentile(steady, 0.5), "steady_p95": percentile(steady, 0.95),
        "during_p50": percentile(during, 0.5), "during_p95": percentile(during, 0.95),
        "steady_samples": len(steady), "during_samples": len(during),
    }


def draft_used(args: argparse.Namespace) -> str | None:
    return args.draft if args.drafter in ("draft-model", "composite") else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--drafter", default="none", help="the server's --drafter (none: plain decoding)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=800, help="tokens each stream generates")
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--warmup-events", type=int, default=12, help="events per stream before the long prompt")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one run, in a child process
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args)))
        return

    modes = args.modes.split(",")
    if not modes or any(mode not in MODES for mode in modes):
        sys.exit(f"--modes takes a comma list of {', '.join(MODES)}, got {args.modes!r}")
    results = []
    for round_ in range(args.rounds):
        for mode in modes if round_ % 2 == 0 else reversed(modes):
            command = [sys.executable, __file__, "--mode", mode] + [
                f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
                if name not in ("mode", "modes", "out", "rounds") and value is not None
            ]
            run = subprocess.run(command, capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit(f"the {mode} run failed:\n{run.stderr[-3000:]}")
            results.append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(f"round {round_ + 1} {mode}: {results[-1]}", file=sys.stderr)

    from verispec.bench.machine import machine_description

    machine = machine_description()
    median = {mode: {key: statistics.median(r[key] for r in results if r["mode"] == mode)
                     for key in results[0] if key != "mode"} for mode in modes}
    lines = [
        f"# Admitting a {median[modes[0]]['long_prompt_tokens']:.0f}-token prompt while {args.streams} streams decode",
        "",
        "    .venv/bin/python benchmarks/scripts/long_prompt_admission.py " + " ".join(sys.argv[1:]),
        "",
        f"Machine: {machine['cpu']} (family/model {machine['cpu_family_model']}; {', '.join(machine['cpu_features'])}), "
        f"{machine['cores']} cores, "
        f"{args.threads} threads. {args.target}, drafter {args.drafter}"
        f"{'' if draft_used(args) is None else ' (' + args.draft + ')'}, greedy, `--k auto`; medians of {args.rounds} "
        "runs per mode, modes alternating, each in a fresh process.",
        "",
        "| prefill | streams' ms/token p50 steady | p95 steady | p50 during | p95 during | p95 during / steady | long prompt's TTFT s |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        m = median[mode]
        lines.append(
            f"| {mode} | {1000 * m['steady_p50']:.1f} | {1000 * m['steady_p95']:.1f} | {1000 * m['during_p50']:.1f} | "
            f"{1000 * m['during_p95']:.1f} | {m['during_p95'] / m['steady_p95']:.2f}x | {m['long_ttft']:.2f} |"
        )
    lines += ["", "\"during\": from the long prompt's arrival to its first token. chunked: `verispec serve --chunked-prefill`, "
              "the chunks in the decoding steps' own forwards; whole: `--no-chunked-prefill` (the default before "
              "chunked prefill was on for batch-invariant targets); own-forwards: "
              "chunked, each chunk a forward of its own (as before the chunks were packed; scheduler.packs_prefill off)."]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "README.md").write_text("\n".join(lines) + "\n")
        (args.out / "results.json").write_text(json.dumps({"machine": machine, "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
