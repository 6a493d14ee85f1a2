"""Command line: `verispec generate`, `serve`, `bench`, `bench-serve`, `doctor` and `models` (cli_models.py)."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

import torch

from verispec import cli_models
from verispec.drafters import DRAFTERS
from verispec.drafters.pairing import cross_tokenizer_note, drafts_across_tokenizers, pair_drafter
from verispec.drafters.draft_vocab import DRAFT_VOCAB_HELP, argparse_vocab
from verispec.models.catalog import DEFAULT_TARGET, ModelNotInstalledError
from verispec.models.linear import QUANTIZE_CHOICES
from verispec.serving.guard import ACCESS_LOG_FORMATS, served_model_name

EXIT_USAGE = 2
TARGET_HELP = "catalog name, .gguf file, Hugging Face directory, or hub id org/name[@revision]"
DRAFT_HELP = (
    "draft model (as --target), 'head' for the draft head `make head` built for the target (or a head's "
    ".safetensors file), or 'none' for plain decoding; default: a catalog target's own draft (its head where "
    "`make head` built one), for any other "
    "target none (the best drafter that needs no model runs)"
)


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


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a probability from 0 to 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability from 0 to 1, got {text}")
    return value


def _k_value(text: str) -> int | str:
    return "auto" if text == "auto" else _non_negative_int(text)


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list (empty items dropped)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value


def _add_format_arguments(parser: argparse.ArgumentParser) -> None:
    """--quantize (the target) and --draft-quantize, as generate and serve take them."""
    parser.add_argument(
        "--quantize", default="auto", choices=QUANTIZE_CHOICES,
        help="target weight format: auto (the fastest batch-invariant format this CPU runs, measured at load), "
        "none (dense), w4a8 (4-bit weights, int8 activations, verispec's VNNI kernel), w8a8 (int8 weights and "
        "activations, oneDNN), int8, int4 (weight-only)",
    )
    parser.add_argument(
        "--draft-quantize", default="auto", choices=QUANTIZE_CHOICES,
        help="draft model format (lossless: only acceptance changes); auto: int4, w4a8 or w8a8, whichever is faster here",
    )
    parser.add_argument("--draft-vocab", default="full", type=argparse_vocab, help=DRAFT_VOCAB_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description="Lossless speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    gen.add_argument("--draft", default=None, help=DRAFT_HELP)
    gen.add_argument(
        "--drafter", default=None, choices=DRAFTERS,
        help="how drafts are proposed: lookup with a draft-model fallback (composite, the default: fastest in the "
        "committed benchmarks), a same-tokenizer draft model, prompt lookup, a suffix index, or a draft model with "
        "another tokenizer",
    )
    gen.add_argument("--corpus", type=Path, action="append", default=[], help="files/directories for --drafter suffix-index")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128)
    gen.add_argument("--k", type=_k_value, default="auto", help="draft tokens per step, or 'auto' (default)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="-2..2, on generated tokens (OpenAI's)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="-2..2, per repeat of a generated token")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages prompt and output tokens")
    gen.add_argument("--json-schema", type=Path, help="a JSON Schema file: the output is one document valid under it")
    gen.add_argument(
        "--seed", type=int, default=0,
        help="sampling seed: with a fixed --k the same seed gives the same text; with --k auto the "
        "distribution is exact but the draw depends on the k chosen at each step",
    )
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    _add_format_arguments(gen)
    gen.add_argument("--threads", type=_positive_int, default=None, help="CPU threads (default: torch's)")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and stats")

    from verispec.core.requests import SchedulerLimits
    from verispec.core.scheduler import SERVED_DRAFTERS

    defaults = SchedulerLimits()
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    serve.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    serve.add_argument("--draft", default=None, help=DRAFT_HELP)
    serve.add_argument(
        "--drafter", default=None, choices=SERVED_DRAFTERS,
        help="how drafts are proposed: composite (the default: each request's suffix index where its text recurs, "
        "else the batched draft model), a same-tokenizer draft model (batched), prompt lookup, a suffix index, "
        "cross-tokenizer "
        "(a draft model with its own vocabulary, one per request), or none",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    _add_format_arguments(serve)
    serve.add_argument("--k", type=_k_value, default="auto", help="draft tokens per step, or 'auto' (default)")
    serve.add_argument("--k-max", type=_positive_int, default=8, help="the longest draft 'auto' considers")
    serve.add_argument("--draft-p-min", type=_probability, default=0.0,
                       help="a row's draft (draft model or head) ends before a token its draft gave less than this "
                       "probability (0: never; as llama.cpp's --draft-p-min)")
    serve.add_argument("--k-per-sequence", action=argparse.BooleanOptionalAction, default=False,
                       help="with --k auto: each sequence drafts as long as its own acceptance pays (else one k per drafter)")
    serve.add_argument("--max-batch-size", type=_positive_int, default=defaults.max_batch_size,
                       help="sequences decoded together; later requests wait")
    serve.add_argument("--max-waiting", type=_positive_int, default=defaults.max_waiting,
                       help="queued requests beyond this are refused with HTTP 429")
    serve.add_argument("--max-context", type=_positive_int, default=defaults.max_context,
                       help="prompt + max_tokens per request (lowered to the model's context)")
    serve.add_argument("--prefix-cache-mb", type=_non_negative_int, default=defaults.prefix_cache_bytes >> 20,
                       help="memory for the keys and values of prompt prefixes that requests share (a system "
                       "prompt, a chat history), reused instead of prefilled again; 0 turns it off")
    serve.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                       help="while others decode, a long prompt goes in by chunks that take its share of each step, "
                       "so the streams keep flowing (at most 1.75x slower); --no-chunked-prefill: every waiting "
                       "prompt goes in whole before the next step; default: on where the target is batch-invariant "
                       "(w4a8, w8a8: the chunks ride in the decoding steps' own forwards), else off (see the README)")
    serve.add_argument("--max-request-bytes", type=_positive_int, default=1 << 20,
                       help="larger request bodies are refused with HTTP 413")
    serve.add_argument("--served-model-name", default=None,
                       help="the model id clients send (default: the catalog name, or the file's or directory's name)")
    network = serve.add_argument_group("on a network (see the README's Deploying section)")
    network.add_argument("--api-key", action="append", default=None, metavar="KEY",
                         help="every /v1 request needs 'Authorization: Bearer KEY' (repeat for several keys; default: "
                         "$VERISPEC_API_KEY, comma-separated; none: open). /health stays open")
    network.add_argument("--metrics-need-key", action="store_true",
                         help="/metrics needs a key too (default: open, like /health, for scrapers)")
    network.add_argument("--request-timeout", type=_seconds, default=600.0,
                         help="a request still generating (or queued) after this many seconds ends with what it has, "
                         "finish_reason 'length' (default 600)")
    network.add_argument("--header-timeout", type=_seconds, default=10.0,
                         help="seconds a connection gets to send a request's headers, else 408 and closed (default 10)")
    network.add_argument("--body-timeout", type=_seconds, default=30.0,
                         help="seconds a request's body gets to arrive once its headers did, else 408 (default 30)")
    network.add_argument("--keep-alive-timeout", type=_seconds, default=5.0,
                         help="seconds an idle keep-alive connection stays open (default 5)")
    network.add_argument("--max-connections", type=_positive_int, default=256,
                         help="open connections beyond this are answered 503 and closed (default 256)")
    network.add_argument("--allowed-origins", type=_names, default=(),
                         help="CORS: comma-separated origins whose web pages may call the API ('*': any); default none")
    network.add_argument("--allowed-hosts", type=_names, default=(),
                         help="comma-separated Host headers accepted (e.g. api.example.com,*.example.com); default any")
    network.add_argument("--docs", action="store_true", help="serve the OpenAPI docs at /docs and /openapi.json")
    network.add_argument("--access-log", choices=ACCESS_LOG_FORMATS, default="text",
                         help="one line per request (id, status, tokens, time to first token, tokens/s, acceptance): "
                         "text (default), json (JSON lines) or off")
    serve.add_argument("--threads", type=_positive_int, default=None,
                       help="CPU threads (default: torch's); with --replicas, split evenly among the replicas")
    ray = serve.add_argument_group("Ray Serve (pip install -e '.[ray]'; see deploy/ray/README.md)")
    ray.add_argument("--replicas", type=_positive_int, default=None,
                     help="run N replicas (models + scheduler each) as a Ray Serve deployment behind its HTTP proxy")
    ray.add_argument("--ray-address", default=None,
                     help="join this Ray cluster ('auto', 'HOST:6379', 'ray://HOST:10001') instead of starting a "
                     "local Ray instance; --threads is then per replica")
    ray.add_argument("--min-replicas", type=_non_negative_int, default=None, help="autoscale from this many replicas")
    ray.add_argument("--max-replicas", type=_positive_int, default=None, help="autoscale up to this many replicas")
    ray.add_argument("--ray-metrics-port", type=_port, default=None,
                     help="the local Ray node exports Prometheus metrics here: Ray Serve's per replica and each "
                     "replica's verispec metrics, tagged replica (default: a port Ray picks)")
    ray.add_argument("--prefix-affinity", action=argparse.BooleanOptionalAction, default=False,
                     help="route requests whose first 1,000 characters agree to the same replica (its prefix cache); "
                     "off by default: see benchmarks/results/xeon/ray-replicas for when it pays")
    ray.add_argument("--target-ongoing-requests", type=float, default=8.0,
                     help="autoscaling: requests in flight per replica it aims at (default 8)")

    from verispec.bench.command import add_arguments

    add_arguments(commands.add_parser("bench", help="measure plain vs speculative decoding (and peers) on a workload"))
    from verispec.bench import serve_load

    serve_load.add_arguments(
        commands.add_parser("bench-serve", help="load-test running OpenAI-compatible servers at 1, 4, 16... clients")
    )
    from verispec.models.forward_cost import DEFAULT_CONTEXT, DEFAULT_ROUNDS

    doctor = commands.add_parser(
        "doctor", help="what this machine is, what each weight format costs here, and what speculation should gain "
        "(run it first when decoding is slower than expected, and paste it into bug reports)",
    )
    doctor.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    doctor.add_argument("--draft", default=None, help="draft model, as --target, or a draft head (`head`: the one "
                        "`make head` built; or a head file); default: the target's head where one is built, else its "
                        "draft model")
    doctor.add_argument("--rounds", type=_positive_int, default=DEFAULT_ROUNDS,
                        help="interleaved timing rounds, after two warm-up rounds; medians are reported")
    doctor.add_argument("--context", type=_positive_int, default=DEFAULT_CONTEXT,
                        help="tokens of prompt in each model's cache before the timed forwards")
    doctor.add_argument("--threads", type=_positive_int, default=None, help="CPU threads (default: torch's)")
    doctor.add_argument("--json", action="store_true", help="print one JSON object instead of tables")

    cli_models.add_arguments(commands.add_parser(
        "models", help="list the catalog models (installed? cached?), the Hugging Face cache's causal LMs, the weight "
        "formats that run here and what each cache takes on disk",
    ))
    return parser


def cmd_doctor(args: argparse.Namespace) -> int:
    """Time what runs here and print it: tables, or JSON on stdout alone; a progress bar on a terminal's stderr."""
    from rich.console import Console
    from rich.progress import Progress

    from verispec.doctor import diagnose
    from verispec.doctor_tables import doctor_tables

    if args.threads:
        torch.set_num_threads(args.threads)
    with Progress(console=Console(stderr=True), transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("verispec doctor", total=None)

        def progress(what: str, done: int, total: int) -> None:
            bar.update(task, description=what, completed=done, total=total)

        report = diagnose(args.target, args.draft, rounds=args.rounds, context=args.context, progress=progress)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    console = Console()
    for table in doctor_tables(report):
        console.print(table)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from verispec import GenerationConfig, SamplingParams, SpeculativeEngine, load_model
    from verispec.drafters import make_drafter

    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = args.prompt if args.prompt is not None else args.prompt_file.read_text()
    sampling = SamplingParams(
        args.temperature, args.top_k, args.top_p, args.min_p, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
    )
    schema = None
    if args.json_schema is not None:
        try:
            schema = json.loads(args.json_schema.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"--json-schema {args.json_schema}: cannot read a JSON schema there ({error})") from None
    drafter_named = args.drafter is not None
    pairing = pair_drafter(args.target, args.draft, args.drafter)
    args.drafter, args.draft = pairing.drafter, pairing.draft
    needs_model = args.drafter in ("draft-model", "cross-tokenizer", "composite")
    plain = args.drafter == "none" or args.k == 0 or (needs_model and args.draft is None)
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
        stop_strings=tuple(args.stop), k=0 if plain else args.k, json_schema=schema,
    )
    progress = not args.json and sys.stderr.isatty()
    target = load_model(args.target, args.dtype, progress=progress, quantize=args.quantize)
    _note(pairing.note)
    drafter = None if plain else make_drafter(
        args.drafter, target, args.draft, args.dtype, args.draft_quantize, args.corpus, progress, args.draft_vocab
    )
    if not drafter_named and drafts_across_tokenizers(drafter):
        _note(cross_tokenizer_note(args.draft, args.target, args.drafter))
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
            "target": args.target, "drafter": "none" if plain else args.drafter,
            "draft": args.draft if not plain and needs_model else None, "target_format": target.format.as_dict(),
            "stats": stats.to_dict(),
        }
        print(json.dumps(payload))
    else:
        print(file=sys.stdout)
        print(
            f"[{stats.new_tokens} tokens in {stats.total_seconds:.2f}s, {stats.tokens_per_second:.1f} tok/s, "
            f"{stats.target_forwards} target forwards, {stats.mean_tokens_per_target_forward:.2f} tokens/forward, "
            f"acceptance {stats.acceptance_rate:.0%}, target {target.format.label}"
            + (f", ~{stats.counterfactual_speedup:.2f}x vs plain (estimated)" if stats.counterfactual_speedup else "")
            + "]",
            file=sys.stderr,
        )
    return 0


def _note(text: str | None) -> None:
    """A line on stderr where a command chose for the user (see pairing); nothing for None."""
    if text:
        print(f"verispec: note: {text}", file=sys.stderr, flush=True)


def _listen(host: str, port: int) -> socket.socket:
    """Bind the server's socket before loading models, so a taken port fails at once and clearly."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    import os

    given = args.api_key if args.api_key is not None else os.environ.get("VERISPEC_API_KEY", "").split(",")
    return tuple(key.strip() for key in given if key.strip())


def server_settings(args: argparse.Namespace):
    """`serve`'s ServerSettings (how the app faces its clients) from its arguments."""
    from verispec.serving.guard import ServerSettings

    return ServerSettings(
        model_name=args.served_model_name or served_model_name(args.target), max_request_bytes=args.max_request_bytes,
        api_keys=api_keys(args), metrics_need_key=args.metrics_need_key, body_timeout=args.body_timeout,
        request_timeout=args.request_timeout, allowed_origins=args.allowed_origins,
        allowed_hosts=args.allowed_hosts, docs=args.docs, access_log=args.access_log,
    )


def cmd_serve_replicas(args: argparse.Namespace) -> int:
    """`serve --replicas N` / `--ray-address`: the server as a Ray Serve deployment (verispec.serving.ray_serve)."""
    import os

    from verispec.serving.ray_serve import ReplicaSettings, run_replicas

    replicas = args.replicas or 1
    most = args.max_replicas if args.max_replicas is not None else replicas
    if args.ray_address is not None:  # a cluster: the threads are each replica's
        threads = args.threads or 1
    else:  # this machine: the threads are split among the replicas it may run
        total = args.threads or os.cpu_count() or 1
        if total < most:
            raise ValueError(
                f"--threads {total} cannot be split among {most} replicas (each needs one); "
                f"lower --replicas/--max-replicas or raise --threads"
            )
        threads = total // most
    pairing = pair_drafter(args.target, args.draft, args.drafter)
    _note(pairing.note)  # a drafter left unnamed beside a draft model is each replica's to choose (by its tokenizer)
    drafter = args.drafter if pairing.draft is not None else pairing.drafter
    settings = ReplicaSettings(
        target=args.target, draft=pairing.draft, drafter=drafter, dtype=args.dtype, quantize=args.quantize,
        draft_quantize=args.draft_quantize, draft_vocab=args.draft_vocab, k=args.k, k_max=args.k_max,
        draft_p_min=args.draft_p_min, max_batch_size=args.max_batch_size,
        max_waiting=args.max_waiting, max_context=args.max_context, prefix_cache_mb=args.prefix_cache_mb,
        chunked_prefill=args.chunked_prefill, max_request_bytes=args.max_request_bytes,
        served_model_name=args.served_model_name, threads=threads, replicas=replicas,
        min_replicas=args.min_replicas, max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests, prefix_affinity=args.prefix_affinity,
        api_keys=list(api_keys(args)), metrics_need_key=args.metrics_need_key, body_timeout=args.body_timeout,
        request_timeout=args.request_timeout, keep_alive_timeout=args.keep_alive_timeout,
        allowed_origins=list(args.allowed_origins), allowed_hosts=list(args.allowed_hosts), docs=args.docs,
        access_log=args.access_log,
    )
    settings.server_settings()  # raises ValueError for a bad one, before Ray starts
    autoscaling = settings.autoscaling  # raises ValueError for min > max
    scaling = (f"{autoscaling['min_replicas']}-{autoscaling['max_replicas']} replicas (autoscaled)"
               if autoscaling else f"{replicas} replicas")
    _listen(args.host, args.port).close()  # a taken port fails now, not after Ray started

    def ready(url: str) -> None:
        print(f"verispec: serving {settings.server_settings().model_name!r} on Ray Serve, {scaling} x "
              f"{threads} threads (drafter {settings.drafter_name}) on {url}", file=sys.stderr, flush=True)

    if args.ray_metrics_port is not None and args.ray_address is not None:
        raise ValueError("--ray-metrics-port is for a local Ray instance; a cluster's nodes set theirs with "
                         "`ray start --metrics-export-port`")
    run_replicas(settings, args.host, args.port, args.ray_address, ready, args.ray_metrics_port)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.replicas is not None or args.ray_address is not None or args.min_replicas is not None \
            or args.max_replicas is not None or args.prefix_affinity:
        return cmd_serve_replicas(args)
    from verispec.serving.app import create_app
    from verispec.serving.http import TransportLimits, configure_server_logging
    from verispec.serving.http import serve as serve_http
    from verispec.serving.metrics import ServerMetrics
    from verispec.serving.scheduler import SchedulerLimits, build_scheduler, start_in_model_thread

    settings = server_settings(args)  # bad values fail before the models load
    transport = TransportLimits(args.header_timeout, args.keep_alive_timeout, args.max_connections)
    sock = _listen(args.host, args.port)
    pairing = pair_drafter(args.target, args.draft, args.drafter)
    metrics = ServerMetrics()
    limits = SchedulerLimits(args.max_batch_size, args.max_waiting, args.max_context, args.prefix_cache_mb << 20)
    try:  # the models are loaded and run in one thread of their own (see start_in_model_thread)
        scheduler = start_in_model_thread(lambda: build_scheduler(
            args.target, pairing.draft, pairing.drafter, args.dtype, args.draft_quantize, args.k, args.k_max, limits,
            metrics, progress=sys.stderr.isatty(), quantize=args.quantize, chunked_prefill=args.chunked_prefill,
            k_per_sequence=args.k_per_sequence, draft_vocab=args.draft_vocab,
            foreign_draft_crosses=args.drafter is None, draft_p_min=args.draft_p_min,
        ), args.threads)
    except BaseException:
        sock.close()
        raise
    drafter = scheduler.drafter
    _note(pairing.note)
    if drafter != pairing.drafter:  # a draft model of another tokenizer: cross-tokenizer (build_scheduler)
        _note(cross_tokenizer_note(pairing.draft, args.target, drafter))
    if scheduler.target.format is not None:
        metrics.set_target(scheduler.target.format.as_dict())
    app = create_app(scheduler, metrics, settings)
    keys = f", {len(settings.api_keys)} API key(s)" if settings.api_keys else ", no API key (open)"
    print(
        f"verispec: serving {settings.model_name!r} as {scheduler.target.format.label} (drafter {drafter}"
        f"{f' over draft {pairing.draft}' if pairing.draft and drafter != 'none' else ''}, k {args.k}, "
        f"batch {limits.max_batch_size}, context {scheduler.limits.max_context}{keys}) on "
        f"http://{args.host}:{sock.getsockname()[1]}/v1",
        file=sys.stderr,
    )
    configure_server_logging()
    try:
        serve_http(app, sock, transport)
    finally:
        scheduler.stop()
        sock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded with benchmark results
    try:
        if args.command == "models":
            return cli_models.run_models(args)
        if args.command == "bench":
            from verispec.bench.command import run_bench

            return run_bench(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "doctor":
            return cmd_doctor(args)
        if args.command == "bench-serve":
            from verispec.bench.serve_load import run_bench_serve

            return run_bench_serve(args, args.argv[1:])
        return cmd_generate(args)
    except (ModelNotInstalledError, ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"verispec: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
