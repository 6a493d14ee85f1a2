"""`verispec bench`: every mode on the same prompts, interleaved; table, results.json, report.md, plots."""

from __future__ import annotations

import argparse
import resource
import shlex
from pathlib import Path

import torch

MODES = ("plain", "spec", "lookup", "suffix", "composite", "cross", "unrelated", "hf-plain", "hf-assisted")
DRAFTER_OF_MODE = {  # our speculative modes, one per drafter; each runs once per --k
    "spec": "draft-model",
    "lookup": "prompt-lookup",
    "suffix": "suffix-index",
    "composite": "composite",
    "cross": "cross-tokenizer",
    "unrelated": "draft-model",  # scrambled: the adversarial case where drafting cannot pay
}


SCHEMA_CHOICES = ("on", "off", "both")
SCHEMA_SUFFIX = "+schema"


def mode_name(mode: str, k: int | str) -> str:
    return f"{mode}-auto" if k == "auto" else f"{mode}-k{k}"


def parse_k_list(text: str) -> list[int | str]:
    try:
        values = [v.strip() if v.strip() == "auto" else int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k takes comma-separated integers or 'auto', got {text!r}") from None
    if not values or any(v != "auto" and v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--k values must be >= 1 or 'auto', got {text!r}")
    return values


def _comma_list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """Split "a,b" into names from `allowed`; argparse reports anything else with the choices."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {what}(s) {unknown}; choose from {', '.join(allowed)}")
    return names


def parse_modes(text: str) -> list[str]:
    return _comma_list(text, MODES, "mode")


def parse_formats(text: str) -> list[str]:
    from verispec.models.linear import QUANTIZE_CHOICES

    return _comma_list(text, QUANTIZE_CHOICES, "format")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from verispec.drafters.draft_vocab import DRAFT_VOCAB_HELP, argparse_vocab
    from verispec.models.linear import QUANTIZE_CHOICES

    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default=None,
                        help="draft model for spec and composite (default: the target's draft head where `make head` "
                             "built one, else its catalog draft model)")
    parser.add_argument("--cross-draft", default="smollm2-135m-instruct", help="draft model (own tokenizer) for cross")
    parser.add_argument("--corpus", type=Path, action="append", default=[], help="files/directories for suffix")
    parser.add_argument("--workload", default="humaneval", help="humaneval, code-edit, chat, or a JSONL file")
    parser.add_argument("--modes", type=parse_modes, default=["plain", "composite"],
                        help=f"comma list of {', '.join(MODES)} (default: plain and the default drafter, composite)")
    parser.add_argument("--k", type=parse_k_list, default=["auto"], help="draft lengths, e.g. 1,2,4,8, or auto (default)")
    parser.add_argument("--hf-k", type=parse_k_list, default=None, help="constant draft lengths for hf-assisted (default: --k)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of the workload")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument(
        "--quantize", type=parse_formats, default=["auto"],
        help="target weight format(s), comma list of auto, none, w4a8, w8a8, int8, int4 (auto: the fastest this CPU "
        "runs); with several, every mode runs on each target, named mode[format], against the first one's plain",
    )
    parser.add_argument("--draft-quantize", default="auto", choices=QUANTIZE_CHOICES)
    parser.add_argument("--draft-vocab", default="full", type=argparse_vocab, help=DRAFT_VOCAB_HELP)
    parser.add_argument(
        "--check", choices=["pass@1"], default=None,
        help="pass@1: run each output against the prompt's own tests (humaneval, or a JSONL with HumanEval's "
        "test and entry_point); generation stops at the end of the function. With a check, plain runs only "
        "if listed in --modes and the first mode is the baseline",
    )
    parser.add_argument(
        "--schema", choices=SCHEMA_CHOICES, default="on",
        help="prompts' json_schema (structured output): on (constrain), off (ignore), both (every mode twice: "
        "free, and constrained as MODE+schema, each against its own plain)",
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))


def build_modes(args, target, console) -> list:
    from verispec.bench.modes import EngineMode, HuggingFaceMode
    from verispec.bench.adversarial import scrambled_drafter
    from verispec.drafters import is_head_spec, make_drafter
    from verispec.engine import SpeculativeEngine
    from verispec.models.catalog import DEFAULT_DRAFT
    from verispec.models.loading import resolve_model

    modes = []
    if "plain" in args.modes:
        modes.append(EngineMode("plain", SpeculativeEngine(target), 0))
    for mode, kind in DRAFTER_OF_MODE.items():
        if mode in args.modes:
            draft = args.cross_draft if mode == "cross" else args.draft
            if mode == "unrelated" and is_head_spec(draft):
                draft = DEFAULT_DRAFT  # the scrambled draft model: a draft that never agrees at a real draft's cost
            drafter = make_drafter(
                kind, target, draft, args.dtype, args.draft_quantize, args.corpus, progress=True, vocab=args.draft_vocab
            )
            if mode == "unrelated":
                drafter = scrambled_drafter(drafter, resolve_model(draft)[1])
            # One engine per mode: the adaptive controller learns only from its own runs.
            modes += [EngineMode(mode_name(mode, k), SpeculativeEngine(target, drafter), k) for k in args.k]
    if "hf-plain" in args.modes or "hf-assisted" in args.modes:
        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            console.print("[yellow]skipping hf-plain / hf-assisted: transformers is not installed (pip install transformers)")
            return modes
        hf_target = AutoModelForCausalLM.from_pretrained(target.directory, dtype=target.model.dtype).eval()
        if "hf-plain" in args.modes:
            modes.append(HuggingFaceMode("hf-plain", hf_target, target.tokenizer, target.eos_token_ids))
        if "hf-assisted" in args.modes:
            _, draft_dir, _ = resolve_model(DEFAULT_DRAFT if is_head_spec(args.draft) else args.draft, progress=True)
            hf_draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=target.model.dtype).eval()
            modes.append(HuggingFaceMode("hf-assisted", hf_target, target.tokenizer, target.eos_token_ids, hf_draft))
            modes += [
                HuggingFaceMode(f"hf-assisted-k{k}", hf_target, target.tokenizer, target.eos_token_ids, hf_draft, k)
                for k in (args.hf_k or args.k)
                if k != "auto"
            ]
    return modes


def made_choices(targets: list, modes: list) -> dict:
    """What the run chose by itself: each target's format and what auto timed for it, each draft model's format
    and its timed one-row forwards (seconds), each mode's drafter and k."""
    drafts, ours = {}, [m for m in modes if hasattr(m, "engine")]  # Hugging Face's modes choose nothing
    for mode in ours:
        drafter = mode.engine.drafter
        for part in getattr(drafter, "drafters", [drafter]):
            check = getattr(getattr(part, "model", None), "format_check", None)
            if check is not None:
                drafts[check.chosen] = dict(check.one_row)
    return {
        "targets": [t.format.as_dict() for t in targets],
        "draft_formats": drafts,
        "modes": {m.name: {"drafter": drafter_label(m.engine.drafter), "k": m.k} for m in ours},
    }


def drafter_label(drafter) -> str:
    """What drafts, in words: "suffix index, then draft head (32768 tokens)" for a composite of the two."""
    from verispec.drafters.draft_head import HeadLayer

    parts = []
    for part in getattr(drafter, "drafters", [drafter]):
        model = getattr(part, "model", None)
        if isinstance(model, HeadLayer):
            parts.append(f"draft head ({len(model.vocab)} tokens)")
        elif getattr(part, "source", None):
            parts.append(part.source.replace("-", " "))
        else:
            parts.append(type(part).__name__)
    return ", then ".join(parts)


def mode_drafter(mode) -> str:
    """What drafts for a mode, in words; "-" for plain decoding."""
    if hasattr(mode, "engine"):
        return "-" if mode.engine.drafter is None else drafter_label(mode.engine.drafter)
    return "-" if mode.assistant is None else "draft model (transformers' assistant)"


def choice_lines(choices: dict) -> list[str]:
    """made_choices as the lines the bench prints under its table."""
    lines = []
    for target in choices["targets"]:
        measured = target["measured_seconds"]
        long_passes = {name: s for name, s in measured.items() if name.startswith("w4a8-")}  # see linear.w4a8_choice
        timed = _milliseconds({name: s for name, s in measured.items() if name not in long_passes})
        lines.append(f"target format: {target['format']} ({target['dtype']})" + (f"; timed {timed}" if timed else "")
                     + (f"; w4a8 prefill passes timed {_milliseconds(long_passes)}" if long_passes else ""))
    for chosen, seconds in choices["draft_formats"].items():
        lines.append(f"draft format: {chosen}; one-row forwards timed: {_milliseconds(seconds)}")
    for name, mode in choices["modes"].items():
        if mode["k"] != 0:
            lines.append(f"{name}: drafter {mode['drafter']}, k {mode['k']}")
    return lines


def _milliseconds(seconds: dict[str, float]) -> str:
    """{"w4a8": 0.2, "none": 0.69} -> "w4a8 200.0 ms, none 690.0 ms", fastest first."""
    return ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in sorted(seconds.items(), key=lambda item: item[1]))


def run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Table

    from verispec.bench.checks import COMPLETION_STOPS, pass_at_1, require_checkable, schema_valid
    from verispec.bench.report import COLUMNS, cells, markdown, narrow_rows, plot, write_results
    from verispec.bench.runner import run_all, summarize_mode
    from verispec.bench.workloads import load_workload, render_prompt
    from verispec.bench.machine import git_commit, machine_description, machine_kind
    from verispec.drafters.pairing import draft_or_default
    from verispec.engine import GenerationConfig
    from verispec.models.loading import load_model
    from verispec.sampling import SamplingParams
    from verispec.terminal import print_note, print_table

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.draft = draft_or_default(args.target, args.draft)  # the head where `make head` built one
    console = Console(stderr=True)
    prompts = load_workload(args.workload, args.limit)
    if args.check:
        require_checkable(prompts, args.workload)
    with_schemas = any("json_schema" in p for p in prompts)
    if args.schema == "off":
        prompts = [{key: value for key, value in p.items() if key != "json_schema"} for p in prompts]
        with_schemas = False
    elif args.schema == "both" and not with_schemas:
        raise ValueError(f'--schema both: no prompt of workload {args.workload!r} has a "json_schema"')
    if with_schemas and {"hf-plain", "hf-assisted"} & set(args.modes):
        raise ValueError("hf-plain / hf-assisted cannot apply the workload's json_schema: pass --schema off, "
                         "or leave them out of --modes")
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, sampling=SamplingParams(temperature=args.temperature), seed=args.seed,
        stop_strings=COMPLETION_STOPS if args.check else (),
    )
    targets = [load_model(args.target, args.dtype, progress=True, quantize=q) for q in args.quantize]
    labels = [t.format.choice.label for t in targets]
    if len(set(labels)) < len(labels):
        raise ValueError(f"--quantize {','.join(args.quantize)} loads the same format twice ({', '.join(labels)})")
    modes = []
    for target in targets:
        built = build_modes(args, target, console)
        if "plain" not in [m.name for m in built] and not args.check:
            from verispec.bench.modes import EngineMode
            from verispec.engine import SpeculativeEngine

            built.insert(0, EngineMode("plain", SpeculativeEngine(target), 0))  # the baseline every speedup needs
        if len(targets) > 1:
            for mode in built:
                mode.name = f"{mode.name}[{target.format.choice.label}]"
        modes += built
    if args.schema == "both":  # the same modes run free, each on an engine (and controller) of its own
        from verispec.bench.modes import EngineMode
        from verispec.engine import SpeculativeEngine

        for mode in list(modes):
            modes.append(EngineMode(mode.name + SCHEMA_SUFFIX, SpeculativeEngine(mode.engine.target, mode.engine.drafter),
                                    mode.k))
            mode.constrained = False
    target = targets[0]

    def baseline_of(mode) -> str:
        """The first mode run the same way (constrained or free): its plain decoding."""
        return next(m.name for m in modes if m.constrained == mode.constrained)

    def render(prompt: dict) -> str:
        return render_prompt(target.tokenizer, prompt)

    # The first schema also builds the tokenizer's grammar compiler (seconds): not part of any prompt's time.
    schema = next((p["json_schema"] for p in prompts if "json_schema" in p), None)
    warmup = GenerationConfig(max_new_tokens=8, sampling=config.sampling, json_schema=schema)
    for mode in modes:
        mode.run(render(prompts[0]), warmup)

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=console, transient=True,
    ) as progress:
        task = progress.add_task(f"bench {args.workload}", total=len(prompts) * len(modes))
        results = run_all(
            modes, prompts, config, render, lambda text: len(target.encode(text)),
            on_run=lambda prompt_id, mode: progress.update(task, advance=1, description=f"{prompt_id} {mode}"),
        )

    greedy = config.sampling.greedy
    summaries = [summarize_mode(results, m.name, baseline_of(m), greedy) for m in modes]
    if with_schemas or args.check:  # each mode's outputs as text, in prompt order
        texts = {m.name: [target.decode(r.runs[m.name].token_ids) for r in results] for m in modes}
    if with_schemas:
        validity = schema_valid(prompts, texts)
        for summary in summaries:
            summary.update(validity[summary["mode"]])
    if args.check:
        with Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console, transient=True
        ) as progress:
            task = progress.add_task(f"running {args.check} tests", total=len(prompts) * len(modes))
            scores = pass_at_1(prompts, texts, on_check=lambda: progress.update(task, advance=1))
        for summary in summaries:
            summary.update(scores[summary["mode"]])
    formats = ", ".join(f"{t.format.label}" for t in targets)
    table = Table(title=f"{args.workload}: {len(prompts)} prompts, {formats}, {torch.get_num_threads()} threads")
    for column in COLUMNS:
        table.add_column(column, justify="right", overflow="fold")
    for summary in summaries:
        table.add_row(*[escape(cell) for cell in cells(summary)])  # "[none]" is not rich markup
    out = Console()
    print_table(out, table, *narrow_rows(summaries, {m.name: mode_drafter(m) for m in modes}))
    choices = made_choices(targets, modes)
    for line in choice_lines(choices):
        print_note(out, line)

    args.out.mkdir(parents=True, exist_ok=True)
    machine = machine_description()
    machine["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    meta = {
        "command": "verispec " + shlex.join(args.argv),
        "machine": machine,
        "workload": args.workload,
        "target": args.target,
        "draft": args.draft,
        "dtype": str(target.model.dtype).replace("torch.", ""),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "draft_quantize": args.draft_quantize,
        "draft_vocab": args.draft_vocab,
        "target_formats": [t.format.as_dict() for t in targets],
        "baseline": modes[0].name,
        "baselines": {m.name: baseline_of(m) for m in modes},
        "schema": args.schema if with_schemas or args.schema == "off" else None,
        "check": args.check,
        "stop_strings": list(config.stop_strings),
        "note": "peak_rss_gib is for the whole process: all modes share it",
        "commit": git_commit(),  # the checkout that ran (None outside one); benchmarks/results/ files by kind
        "machine_kind": machine_kind(),
        "choices": choices,
    }
    write_results(args.out, meta, summaries, results)
    plots = plot(args.out, summaries, results)
    (args.out / "report.md").write_text(markdown(meta, summaries, results, plots))
    console.print(f"wrote {args.out}/results.json, report.md and {len(plots)} plots")
    return 0
