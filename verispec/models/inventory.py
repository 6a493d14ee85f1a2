"""The models this machine holds and what they take on disk; freeing them (`verispec models`, `--rm`).

Catalog models live in verispec's cache: a converted safetensors directory (cache_root()/NAME) and, once a peer
asked for it, the assembled GGUF file (cache_root()/gguf/NAME.gguf). Hub models live in huggingface_hub's cache.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from verispec.models.catalog import CATALOG, is_installed
from verispec.models.hub import cached_hub_models, looks_like_hub_id, remove_cached_hub_model, split_hub_id
from verispec.models.loading import cached_dir, cached_gguf, is_cached


@dataclass(frozen=True)
class CatalogModel:
    """A catalog model as this machine holds it."""

    name: str
    description: str
    installed: bool  # its packages are installed, at the right version
    cached: bool  # converted into verispec's cache (loads in seconds)
    cache_bytes: int  # verispec's cache of it on disk: converted directory and assembled GGUF file
    pip_install: str  # the command that installs it


@dataclass(frozen=True)
class Freed:
    """What `remove_model` deleted."""

    name: str
    cache: str  # "verispec" or "Hugging Face"
    paths: tuple[Path, ...]  # what was removed (a hub model: its folder in the cache)
    bytes: int


def catalog_models() -> list[CatalogModel]:
    """Every catalog model, installed or not, with its cache's size."""
    return [
        CatalogModel(entry.name, entry.description, is_installed(entry), is_cached(entry.name),
                     sum(map(disk_bytes, catalog_cache_paths(entry.name))), entry.pip_install)
        for entry in CATALOG.values()
    ]


def catalog_cache_paths(name: str) -> list[Path]:
    """The files and directories of verispec's cache that hold catalog model `name` and exist (not its remembered
    format choices, a few bytes that are checked against the weights anyway)."""
    gguf = cached_gguf(name)
    candidates = [
        cached_dir(name), cached_dir(name).with_name(f"{name}.partial"),  # (.partial: an interrupted conversion)
        gguf, gguf.with_name(f"{gguf.name}.sha256"), gguf.with_name(f"{gguf.name}.partial"),
    ]
    return [path for path in candidates if path.exists()]


def disk_bytes(path: Path) -> int:
    """A file's size, or the sum of a directory's files (links not followed)."""
    if not path.is_dir():
        return path.lstat().st_size
    return sum((Path(root) / name).lstat().st_size for root, _, names in os.walk(path) for name in names)


def why_verispec_cannot_run(directory: Path) -> str | None:
    """Why verispec cannot load the model whose config.json is in `directory` (the reason's first clause), or None."""
    from verispec.models.config import ModelConfig

    try:
        ModelConfig.from_dir(directory)
    except (ValueError, KeyError, TypeError, OSError) as error:
        return str(error).partition(";")[0]
    return None


def remove_model(name: str) -> Freed:
    """Delete a catalog model's verispec cache, or every cached revision of hub model `name` (`org/name`)."""
    if name in CATALOG:
        paths = catalog_cache_paths(name)
        freed = sum(map(disk_bytes, paths))
        for path in paths:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        return Freed(name, "verispec", tuple(paths), freed)
    if looks_like_hub_id(name):
        repo_id, revision = split_hub_id(name)
        if revision is not None:
            raise ValueError(f"--rm takes a hub id without a revision ({repo_id}): it frees every cached revision")
        removed = remove_cached_hub_model(repo_id)
        if removed is not None:
            folder, freed = removed
            return Freed(repo_id, "Hugging Face", (folder,), freed)
    cached = ", ".join(model.repo_id for model in cached_hub_models()) or "none"
    raise ValueError(
        f"no model {name!r} to remove: the catalog has {', '.join(CATALOG)}; the Hugging Face cache holds these "
        f"causal LMs: {cached} (see `verispec models`)"
    )
