"""Command line: `verispec generate` and `verispec models`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from verispec.models.catalog import CATALOG, ModelNotInstalledError, is_installed

EXIT_USAGE = 2


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description="Lossless speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="catalog name, .gguf file or HF directory")
    gen.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="draft model, or 'none' for plain decoding")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128)
    gen.add_argument("--k", type=_non_negative_int, default=5, help="draft tokens per step")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument(
        "--draft-quantize", default="auto", choices=["auto", "none", "int8", "int4"],
        help="weight-only quantization of the draft model (lossless: only acceptance changes)",
    )
    gen.add_argument("--threads", type=_positive_int, default=None, help="CPU threads (default: torch's)")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and stats")

    cmp = commands.add_parser("compare", help="plain vs speculative decoding on HumanEval prompts, side by side")
    cmp.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    cmp.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    cmp.add_argument("--limit", type=_positive_int, default=5, help="number of HumanEval prompts")
    cmp.add_argument("--max-new-tokens", type=_positive_int, default=128)
    cmp.add_argument("--k", type=_positive_int, default=5)
    cmp.add_argument("--temperature", type=float, default=0.0)
    cmp.add_argument("--seed", type=int, default=0)
    cmp.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    cmp.add_argument("--draft-quantize", default="auto", choices=["auto", "none", "int8", "int4"])
    cmp.add_argument("--threads", type=_positive_int, default=None)
    cmp.add_argument("--out", type=Path, default=None, help="write results.json and report.md here")

    from verispec.bench.command import add_arguments

    add_arguments(commands.add_parser("bench", help="measure plain vs speculative decoding (and peers) on a workload"))
    commands.add_parser("models", help="list the packaged models and whether they are installed and cached")
    return parser


def cmd_compare(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from verispec import GenerationConfig, SamplingParams, SpeculativeEngine, load_draft_model, load_model
    from verispec.compare import compare, humaneval_prompts, machine_description, summarize

    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, sampling=SamplingParams(temperature=args.temperature),
        seed=args.seed, k=args.k,
    )
    console.print(f"loading {args.target} and {args.draft} ...")
    target = load_model(args.target, args.dtype, progress=True)
    drafter = load_draft_model(args.draft, target, args.dtype, args.draft_quantize, progress=True)
    prompts = humaneval_prompts(args.limit)
    plain, spec = SpeculativeEngine(target), SpeculativeEngine(target, drafter)
    plain.generate(prompts[0]["prompt"], GenerationConfig(max_new_tokens=8, k=0))  # warm up both paths
    spec.generate(prompts[0]["prompt"], GenerationConfig(max_new_tokens=8, k=args.k))
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("plain vs speculative", total=len(prompts))
        results = compare(plain, spec, prompts, config, on_result=lambda r: progress.advance(task))
    summary = summarize(results)

    table = Table(title=f"{args.target} + {args.draft}, k={args.k}, {target.model.dtype}, "
                        f"{torch.get_num_threads()} threads, {args.max_new_tokens} new tokens")
    for column in ("prompt", "plain tok/s", "spec tok/s", "speedup", "accept", "tok/fwd", "same"):
        table.add_column(column, justify="right")
    for r in results:
        s = r.spec.stats
        table.add_row(r.prompt_id, f"{r.plain.stats.tokens_per_second:.2f}", f"{s.tokens_per_second:.2f}",
                      f"{r.speedup:.2f}x", f"{s.acceptance_rate:.0%}", f"{s.mean_tokens_per_target_forward:.2f}",
                      "yes" if r.identical else "no")
    table.add_row("all", f"{summary['plain_tokens_per_second']:.2f}", f"{summary['spec_tokens_per_second']:.2f}",
                  f"{summary['speedup_total']:.2f}x", f"{summary['acceptance_rate']:.0%}",
                  f"{summary['mean_tokens_per_target_forward']:.2f}",
                  f"{summary['identical_outputs']}/{summary['prompts']}", style="bold")
    Console().print(table)
    Console().print(
        f"plain {summary['plain_tokens_per_second']:.2f} tok/s, speculative {summary['spec_tokens_per_second']:.2f} "
        f"tok/s: {summary['speedup_total']:.2f}x (median per prompt {summary['speedup_median']:.2f}x), "
        f"acceptance rate {summary['acceptance_rate']:.0%}"
    )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        command = "verispec " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("verispec") else " ".join(sys.argv)
        record = {
            "command": command, "machine": machine_description(), "summary": summary,
            "settings": {k: str(v) for k, v in vars(args).items() if k != "out"},
            "prompts": [r.to_dict() for r in results],
        }
        (args.out / "results.json").write_text(json.dumps(record, indent=1))
        console.print(f"wrote {args.out / 'results.json'}")
    return 0


def cmd_models() -> int:
    from rich.console import Console
    from rich.table import Table

    from verispec.models.loading import cache_root, is_cached

    table = Table(title=f"verispec models (cache: {cache_root()})")
    table.add_column("name", no_wrap=True)
    for column in ("description", "installed", "cached", "install with"):
        table.add_column(column, overflow="fold")
    for entry in CATALOG.values():
        installed = is_installed(entry)
        table.add_row(
            entry.name, entry.description, "yes" if installed else "no",
            "yes" if is_cached(entry.name) else "no", "" if installed else entry.pip_install,
        )
    Console().print(table)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from verispec import GenerationConfig, SamplingParams, SpeculativeEngine, load_draft_model, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = args.prompt if args.prompt is not None else args.prompt_file.read_text()
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p)
    plain = args.draft.lower() == "none" or args.k == 0
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
        stop_strings=tuple(args.stop), k=0 if plain else args.k,
    )
    progress = not args.json and sys.stderr.isatty()
    target = load_model(args.target, args.dtype, progress=progress)
    drafter = None if plain else load_draft_model(args.draft, target, args.dtype, args.draft_quantize, progress)
    if args.chat:
        prompt = target.apply_chat_template(prompt)
    stream = SpeculativeEngine(target, drafter).stream(prompt, config)
    for delta in stream:
        if not args.json:
            sys.stdout.write(delta)
            sys.stdout.flush()
    result = stream.result
    stats = result.stats
    if args.json:
        payload = {
            "text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
            "target": args.target, "draft": None if plain else args.draft, "stats": stats.to_dict(),
        }
        print(json.dumps(payload))
    else:
        print(file=sys.stdout)
        print(
            f"[{stats.new_tokens} tokens in {stats.total_seconds:.2f}s, {stats.tokens_per_second:.1f} tok/s, "
            f"{stats.target_forwards} target forwards, {stats.mean_tokens_per_target_forward:.2f} tokens/forward, "
            f"acceptance {stats.acceptance_rate:.0%}]",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded with benchmark results
    try:
        if args.command == "models":
            return cmd_models()
        if args.command == "compare":
            return cmd_compare(args)
        if args.command == "bench":
            from verispec.bench.command import run_bench

            return run_bench(args)
        return cmd_generate(args)
    except (ModelNotInstalledError, ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"verispec: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
