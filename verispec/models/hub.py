"""Models by Hugging Face id, `org/name` or `org/name@revision`, through huggingface_hub's cache.

The cache is huggingface_hub's own: $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub
(read when called, not when imported). A model already in the cache is used as it is, without touching the
network; one that is not is downloaded (config, tokenizer, generation config and safetensors weights only)
unless $HF_HUB_OFFLINE is set. Tokens come from where huggingface_hub looks ($HF_TOKEN, `hf auth login`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

# What a model needs: its config, its tokenizer in any of the forms transformers reads, its stop ids and its
# weights in safetensors (top level only: `original/` and other subfolders hold other formats).
ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "chat_template.json", "chat_template.jinja", "*.safetensors",
    "model.safetensors.index.json",
]
IGNORE_PATTERNS = ["*/*", "consolidated*"]  # subfolders; Mistral's second copy of the weights in its own layout
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?")
_TRUE = {"1", "ON", "YES", "TRUE"}
_HOW_TO_GET = (  # a model the cache lacks, where the hub is out of reach
    "run once where the hub is reachable, or `hf download {repo_id}` there and copy the cache, or pass the "
    "model's directory instead"
)


class HubModelError(FileNotFoundError):
    """A hub model that cannot be had: not in the cache while offline, not on the hub, or not reachable."""


def looks_like_hub_id(spec: str) -> bool:
    """`org/name` or `org/name@revision` (whether it is meant as a local path is the caller's to decide)."""
    return HUB_ID.fullmatch(spec) is not None


def split_hub_id(spec: str) -> tuple[str, str | None]:
    """("org/name", "revision" or None) of `org/name@revision`."""
    repo_id, _, revision = spec.partition("@")
    return repo_id, revision or None


def hub_cache_dir() -> Path:
    """huggingface_hub's cache folder as the environment names it now."""
    if os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ.get("HF_HUB_CACHE") or os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")).expanduser() / "hub"


def hub_offline() -> bool:
    """$HF_HUB_OFFLINE (or $TRANSFORMERS_OFFLINE) as the environment sets it now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def hub_snapshot(spec: str, progress: bool = False) -> Path:
    """The snapshot directory of hub model `spec` (`org/name[@revision]`): from the cache, else downloaded.

    A download shows huggingface_hub's progress bars when `progress`, nothing otherwise.
    """
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    repo_id, revision = split_hub_id(spec)
    try:
        folder = _download(repo_id, revision, progress, local_files_only=True)
    except LocalEntryNotFoundError:
        folder = None
    except HFValidationError as error:
        raise ValueError(f"{spec!r} is not a valid Hugging Face id: {error}") from None
    if folder is not None and missing_files(folder) == []:
        return folder
    if hub_offline():
        raise HubModelError(_not_cached_message(spec, folder))
    folder = _download_from_hub(spec, repo_id, revision, progress)
    missing = missing_files(folder)
    if missing:
        raise ValueError(
            f"hub model {spec!r} holds no {' or '.join(missing)}; verispec loads safetensors weights with their "
            "config.json and tokenizer (a repo with only .bin, .pt or GGUF weights: pass a converted directory, "
            "or a .gguf file)"
        )
    return folder


def missing_files(folder: Path) -> list[str]:
    """What a snapshot lacks to be loaded: config.json, safetensors weights (every shard its index names)."""
    missing = [] if (folder / "config.json").exists() else ["config.json"]
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        if not shards or not all((folder / shard).exists() for shard in shards):
            missing.append("safetensors weights (some shards of model.safetensors.index.json)")
    elif not any(folder.glob("*.safetensors")):
        missing.append("safetensors weights")
    return missing


def _download(repo_id: str, revision: str | None, progress: bool, local_files_only: bool) -> Path:
    from huggingface_hub import snapshot_download

    folder = snapshot_download(
        repo_id, revision=revision, cache_dir=hub_cache_dir(), local_files_only=local_files_only,
        allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS, tqdm_class=None if progress else _quiet_tqdm(),
    )
    return Path(folder)


def _download_from_hub(spec: str, repo_id: str, revision: str | None, progress: bool) -> Path:
    """_download over the network, its failures said in a sentence with what to do."""
    from huggingface_hub.errors import (
        GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
    )

    try:
        return _download(repo_id, revision, progress, local_files_only=False)
    except GatedRepoError:
        raise HubModelError(
            f"hub model {repo_id!r} is gated: accept its terms on huggingface.co, then log in (`hf auth login`) "
            "or set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise HubModelError(
            f"hub model {repo_id!r} has no revision {revision!r}; name a branch, a tag or a commit"
        ) from None
    except RepositoryNotFoundError:
        raise HubModelError(
            f"{spec!r} is not a catalog name, a local file or directory, or a model on the Hugging Face hub "
            "(a private one needs `hf auth login` or HF_TOKEN)"
        ) from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:  # no network, or the hub failed
        reason = str(error).partition("\n")[0]
        raise HubModelError(
            f"cannot download hub model {spec!r} ({type(error).__name__}: {reason}); "
            f"{_HOW_TO_GET.format(repo_id=repo_id)}"
        ) from None



def _not_cached_message(spec: str, folder: Path | None) -> str:
    repo_id, _ = split_hub_id(spec)
    where = f"the Hugging Face cache ({hub_cache_dir()})"
    if folder is None:
        found = f"{spec!r} is not a catalog name or a local file or directory, and as a hub id it is not in {where}"
    else:
        found = f"hub model {spec!r} in {where} lacks {' and '.join(missing_files(folder))}"
    return f"{found}; HF_HUB_OFFLINE is set, so nothing is downloaded: {_HOW_TO_GET.format(repo_id=repo_id)}"


def _quiet_tqdm():
    """huggingface_hub's progress bar class, always disabled: library code prints nothing unless asked."""
    from huggingface_hub.utils import tqdm

    class QuietTqdm(tqdm):
        def __init__(self, *args, **kwargs) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return QuietTqdm


@dataclass(frozen=True)
class CachedHubModel:
    """A causal language model in the Hugging Face cache."""

    repo_id: str
    architecture: str  # config.json's model_type
    refs: tuple[str, ...]  # branches and tags cached (a revision cached by commit alone shows its short hash)
    size_bytes: int  # on disk, every cached revision
    snapshot: Path  # the newest revision's directory


def cached_hub_models() -> list[CachedHubModel]:
    """The causal language models in the Hugging Face cache, by id (models of other kinds and datasets left out)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir(hub_cache_dir())
    except CacheNotFound:
        return []
    models = []
    for repo in cache.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda revision: revision.last_modified)
        architecture = _causal_lm_type(newest.snapshot_path / "config.json")
        if architecture is None:
            continue
        refs = sorted(ref for revision in repo.revisions for ref in revision.refs)
        refs += sorted(r.commit_hash[:8] for r in repo.revisions if not r.refs)
        models.append(CachedHubModel(repo.repo_id, architecture, tuple(refs), repo.size_on_disk, newest.snapshot_path))
    return sorted(models, key=lambda model: model.repo_id.lower())


def _causal_lm_type(config_path: Path) -> str | None:
    """config.json's model_type where it names a causal language model: a model_type transformers generates with,
    and where config.json lists its architectures, one of them its causal LM class (not BertForMaskedLM)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    model_type, architectures = config.get("model_type"), config.get("architectures") or []
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return model_type if not architectures or causal.intersection(architectures) else None


def remove_cached_hub_model(repo_id: str) -> tuple[Path, int] | None:
    """Delete every cached revision of `repo_id` from the Hugging Face cache: (its folder, the bytes freed), or None
    where it is not cached."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir(hub_cache_dir())
    except CacheNotFound:
        return None
    repo = next((r for r in cache.repos if r.repo_type == "model" and r.repo_id == repo_id), None)
    if repo is None:
        return None
    if not repo.revisions:  # an empty entry (an interrupted first download): nothing to free but the folder
        shutil.rmtree(repo.repo_path, ignore_errors=True)
        return repo.repo_path, 0
    strategy = cache.delete_revisions(*(revision.commit_hash for revision in repo.revisions))
    strategy.execute()
    return repo.repo_path, strategy.expected_freed_size
