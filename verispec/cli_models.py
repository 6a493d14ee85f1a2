"""`verispec models`: the catalog, the Hugging Face cache's causal LMs and the weight formats that run here,
`--paths` (each installed model's files, for other engines) and `--rm` (free a model's cache).

Kept apart from cli.py, whose other commands load and run models: this one only reports what is on disk and
what runs here, and frees disk.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from verispec.models.catalog import CATALOG, ModelNotInstalledError, is_installed

if TYPE_CHECKING:
    from rich.console import Console


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `models` subcommand's arguments."""
    parser.add_argument("names", nargs="*", metavar="NAME", help="with --paths: only these catalog models")
    parser.add_argument(
        "--paths", action="store_true",
        help="assemble (if needed) and print each installed model's GGUF file and converted safetensors "
        "directory, one 'NAME GGUF DIR' line each, for other engines (llama.cpp, vLLM) to load",
    )
    parser.add_argument(
        "--rm", metavar="NAME", default=None,
        help="free a catalog model's verispec cache, or a hub model (org/name) from the Hugging Face cache",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON object instead")


def run_models(args: argparse.Namespace) -> int:
    """`verispec models [--paths [NAME ...]] [--rm NAME] [--json]`."""
    if args.names and not args.paths:
        raise ValueError("model names are for --paths: `verispec models --paths NAME ...`")
    if args.rm is not None:
        return cmd_remove_model(args.rm)
    return cmd_model_paths(args.names, args.json) if args.paths else cmd_models(args.json)


def cmd_model_paths(names: list[str], as_json: bool) -> int:
    """Prepare the models' files once and print where they are: peers read the same weights we do."""
    from verispec.models.loading import prepare_catalog_gguf, prepare_catalog_model

    unknown = [name for name in names if name not in CATALOG]
    if unknown:
        raise ValueError(f"unknown model {unknown[0]!r}; the catalog has: {', '.join(CATALOG)}")
    entries = [CATALOG[name] for name in names] if names else [e for e in CATALOG.values() if is_installed(e)]
    if not entries:
        raise ModelNotInstalledError("no catalog model is installed; run `make models` first")
    progress = sys.stderr.isatty()
    paths = {}
    for entry in entries:  # a missing package raises ModelNotInstalledError with the pip command
        gguf = prepare_catalog_gguf(entry, progress)
        paths[entry.name] = {"gguf": str(gguf), "converted": str(prepare_catalog_model(entry, progress))}
    if as_json:
        print(json.dumps(paths, indent=2))
    else:
        for name, where in paths.items():
            print(name, where["gguf"], where["converted"])
    return 0


def cmd_models(as_json: bool) -> int:
    """The catalog, the Hugging Face cache's causal LMs and the formats that run here: tables, or one JSON object."""
    from rich.console import Console

    from verispec.doctor import format_availability
    from verispec.models.hub import cached_hub_models, hub_cache_dir
    from verispec.models.inventory import catalog_models, why_verispec_cannot_run
    from verispec.models.loading import cache_root, resolve_dtype
    from verispec.terminal import print_note

    catalog, hub = catalog_models(), cached_hub_models()
    formats = format_availability(resolve_dtype("auto"))
    if as_json:
        print(json.dumps({
            "catalog": [{**vars(model), "cache": str(cache_root() / model.name)} for model in catalog],
            "hub": [{**vars(model), "snapshot": str(model.snapshot), "why_not": why_verispec_cannot_run(model.snapshot)}
                    for model in hub],
            "formats": {name: {"runs": f["runs"], "why_not": f["why_not"]} for name, f in formats.items()},
            "caches": {"verispec": str(cache_root()), "hugging_face": str(hub_cache_dir())},
        }, indent=1))
        return 0
    console = Console()
    _print_catalog(console, catalog)
    _print_hub(console, hub)
    runs = [name for name, f in formats.items() if f["runs"]]
    for note in (
        f"weight formats that run here: {', '.join(runs)}"
        + "".join(f"; not {name}: {f['why_not']}" for name, f in formats.items() if not f["runs"]),
        "--quantize auto: a target's format is timed at its first load on this machine (whole forwards in each "
        "format); `verispec doctor` shows the choice in force and what each format costs",
        "`verispec models --rm NAME` frees a catalog model's cache or a hub model (org/name)",
    ):
        print_note(console, note)
    return 0


def _print_catalog(console: Console, catalog: list) -> None:
    """The catalog as a table; in a narrow terminal one line per model, and how to install each one missing."""
    from rich.table import Table

    from verispec.models.loading import cache_root
    from verispec.terminal import print_table

    table = Table(title=f"catalog models (verispec cache: {cache_root()})")
    table.add_column("name", no_wrap=True)
    for column in ("description", "installed", "cached", "on disk", "install with"):
        table.add_column(column, overflow="fold")
    for model in catalog:
        table.add_row(
            model.name, model.description, _yes_no(model.installed), _yes_no(model.cached), _size(model.cache_bytes),
            "" if model.installed else model.pip_install,
        )
    narrow = [[m.name, _yes_no(m.installed), _yes_no(m.cached), _size(m.cache_bytes), m.description] for m in catalog]
    installs = [f"{m.name}: install with {m.pip_install}" for m in catalog if not m.installed]
    print_table(console, table, ["name", "installed", "cached", "on disk", "description"], narrow, installs)


def _print_hub(console: Console, hub: list) -> None:
    """The Hugging Face cache's causal LMs as a table; in a narrow terminal one line per model, and why verispec
    cannot run those it cannot."""
    from rich.table import Table

    from verispec.models.hub import hub_cache_dir
    from verispec.models.inventory import why_verispec_cannot_run
    from verispec.terminal import print_table

    table = Table(title=f"Hugging Face models, causal LMs (cache: {hub_cache_dir()})")
    for column in ("id", "architecture", "revisions", "on disk", "verispec runs it"):
        table.add_column(column, overflow="fold")
    why_not = {model.repo_id: why_verispec_cannot_run(model.snapshot) for model in hub}
    for model in hub:
        reason = why_not[model.repo_id]
        table.add_row(model.repo_id, model.architecture, ", ".join(model.refs), _size(model.size_bytes),
                      "yes" if reason is None else f"no: {reason}")
    none_yet = "(none: `--target org/name` downloads one)"
    if not hub:
        table.add_row(none_yet, "", "", "", "")
    headers = ["id", "on disk", "verispec runs it", "architecture"] if hub else ["id"]
    narrow = [[m.repo_id, _size(m.size_bytes), _yes_no(why_not[m.repo_id] is None), m.architecture] for m in hub]
    reasons = [f"{repo_id}: verispec cannot run it: {reason}" for repo_id, reason in why_not.items() if reason]
    print_table(console, table, headers, narrow or [[none_yet]], reasons)


def _yes_no(value: bool) -> str:
    return "yes" if value else "no"


def _size(num_bytes: int) -> str:
    """1536 -> "1.5 KiB"; 0 -> "-"."""
    if num_bytes == 0:
        return "-"
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            break
        size /= 1024
    return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"


def cmd_remove_model(name: str) -> int:
    """`verispec models --rm NAME`: delete the model's cache and say what that freed."""
    from verispec.models.inventory import remove_model

    freed = remove_model(name)
    if not freed.paths:
        print(f"{name}: nothing in the {freed.cache} cache to free")
    else:
        print(f"{name}: freed {_size(freed.bytes)} from the {freed.cache} cache ({', '.join(map(str, freed.paths))})")
    return 0
