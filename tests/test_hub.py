"""Hugging Face ids from a hub-layout cache built on disk, offline; drafter pairing; `verispec models` and `--rm`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import REPEATING_PROMPT
from verispec.cli import main
from verispec.models.loading import resolve_model

MAIN_COMMIT = "0123456789abcdef0123456789abcdef01234567"
V1_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
GENERATE = ["generate", "--dtype", "float32", "--quantize", "none", "--max-new-tokens", "6", "--json"]


def add_to_hub_cache(cache: Path, repo_id: str, source: Path, commit: str, ref: str | None = "main") -> Path:
    """Put `source`'s files into `cache` as huggingface_hub lays out a download: blobs named by their sha256,
    a snapshot folder of relative links to them, and refs/REF holding the commit. Returns the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(source.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, repo / "blobs" / digest)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", digest))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, own_cache) -> Path:
    """An empty Hugging Face cache of the test's own ($HF_HOME/hub), offline: nothing may reach the network."""
    import huggingface_hub.constants

    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read by huggingface_hub at import
    (home / "hub").mkdir(parents=True)
    return home / "hub"


@pytest.fixture
def tiny_on_hub(hub_cache, tiny_dir, other_tiny_dir) -> dict[str, Path]:
    """org/tiny: main is the tiny model, tag v1 another one; snapshots by revision."""
    return {
        "main": add_to_hub_cache(hub_cache, "org/tiny", tiny_dir, MAIN_COMMIT),
        "v1": add_to_hub_cache(hub_cache, "org/tiny", other_tiny_dir, V1_COMMIT, ref="v1"),
    }


def generate_json(capsys, *args: str) -> tuple[dict, str]:
    assert main([*GENERATE, *args]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_hub_ids_resolve_offline_by_branch_tag_and_commit(tiny_on_hub):
    name, directory, extra_eos = resolve_model("org/tiny")
    assert (name, directory, extra_eos) == ("org/tiny", tiny_on_hub["main"], ())
    assert resolve_model("org/tiny@main")[1] == tiny_on_hub["main"]
    assert resolve_model("org/tiny@v1")[1] == tiny_on_hub["v1"]
    assert resolve_model(f"org/tiny@{V1_COMMIT}")[1] == tiny_on_hub["v1"]


def test_a_local_path_wins_over_a_hub_id(tiny_on_hub, other_tiny_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "tiny").symlink_to(other_tiny_dir, target_is_directory=True)
    assert resolve_model("org/tiny")[1] == Path("org/tiny")


def test_an_uncached_hub_id_offline_says_how_to_get_it(hub_cache, capsys):
    from verispec.models.hub import HubModelError

    with pytest.raises(HubModelError) as raised:
        resolve_model("org/missing")
    message = str(raised.value)
    assert "not in the Hugging Face cache" in message and str(hub_cache) in message
    assert "HF_HUB_OFFLINE" in message and "hf download org/missing" in message
    assert main([*GENERATE, "--target", "org/missing", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "hf download org/missing" in err and "Traceback" not in err
    assert "note" not in err  # the drafter chosen for a target that never loaded goes unsaid


def test_a_cached_repo_without_safetensors_weights_says_verispec_needs_them(hub_cache, tiny_dir, tmp_path):
    from verispec.models.hub import HubModelError

    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    add_to_hub_cache(hub_cache, "org/bin-only", no_weights, MAIN_COMMIT)
    with pytest.raises(HubModelError, match="lacks safetensors weights"):
        resolve_model("org/bin-only")


def test_generate_from_a_hub_id_offline_equals_the_directory(tiny_on_hub, tiny_dir, capsys):
    hub, _ = generate_json(capsys, "--target", "org/tiny", "--draft", "none", "--prompt", "def add(a, b):")
    local, _ = generate_json(capsys, "--target", str(tiny_dir), "--draft", "none", "--prompt", "def add(a, b):")
    assert hub["target"] == "org/tiny" and isinstance(hub["text"], str)
    assert hub["token_ids"] == local["token_ids"] and len(hub["token_ids"]) > 0
    assert main(["generate", "--target", "org/tiny", "--draft", "none", "--prompt", "def add(a, b):",
                 "--max-new-tokens", "4", "--dtype", "float32", "--quantize", "none"]) == 0
    assert capsys.readouterr().out.strip()  # streamed text


def test_a_target_without_a_known_draft_runs_the_best_model_free_drafter(tiny_on_hub, tiny_dir, capsys):
    plain, _ = generate_json(capsys, "--target", str(tiny_dir), "--draft", "none", "--prompt", REPEATING_PROMPT)
    for target in ("org/tiny", str(tiny_dir)):
        paired, err = generate_json(capsys, "--target", target, "--prompt", REPEATING_PROMPT)
        assert "drafting with suffix-index" in err and "suffix-index, prompt-lookup" in err and "--draft MODEL" in err
        assert paired["drafter"] == "suffix-index" and paired["draft"] is None
        assert paired["token_ids"] == plain["token_ids"]
    named, err = generate_json(capsys, "--target", "org/tiny", "--drafter", "prompt-lookup", "--prompt", "x")
    assert named["drafter"] == "prompt-lookup" and "note" not in err


def test_pairing_drafts_a_catalog_target_with_its_shipped_or_built_head_else_the_catalog_draft(
        own_cache, tmp_path, monkeypatch):
    from verispec.drafters import draft_head
    from verispec.drafters.pairing import pair_drafter
    from verispec.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

    shipped = pair_drafter(DEFAULT_TARGET, None, None)  # a fresh clone: the head verispec ships
    assert (shipped.drafter, shipped.draft) == ("composite", "head")
    assert DEFAULT_DRAFT in shipped.note and str(draft_head.SHIPPED_HEADS) in shipped.note
    assert pair_drafter(DEFAULT_TARGET, DEFAULT_DRAFT, None).draft == DEFAULT_DRAFT  # named: kept
    monkeypatch.setattr(draft_head, "SHIPPED_HEADS", tmp_path / "none-shipped")
    assert pair_drafter(DEFAULT_TARGET, None, None) == pair_drafter(DEFAULT_TARGET, DEFAULT_DRAFT, None)
    assert pair_drafter(DEFAULT_TARGET, None, None).draft == DEFAULT_DRAFT
    assert pair_drafter(DEFAULT_TARGET, None, None).note is None
    assert pair_drafter("org/tiny", "none", None).drafter == "none"  # --draft none: plain decoding, no note
    assert pair_drafter("org/tiny", None, "suffix-index").note is None
    built = draft_head.built_head_path(DEFAULT_TARGET)
    built.parent.mkdir(parents=True)
    built.write_bytes(b"")  # `make head` built one (what it holds is read at load)
    assert (pair_drafter(DEFAULT_TARGET, None, None).drafter, pair_drafter(DEFAULT_TARGET, None, None).draft) == (
        "composite", "head")
    assert str(built) in pair_drafter(DEFAULT_TARGET, None, None).note


@pytest.fixture(scope="module")
def foreign_draft_dir(tmp_path_factory, other_tiny_dir) -> Path:
    """other_tiny_dir with two token ids swapped in its tokenizer: a vocabulary that is not the target's."""
    directory = tmp_path_factory.mktemp("foreign-draft")
    shutil.copytree(other_tiny_dir, directory, dirs_exist_ok=True)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    return directory


def test_a_draft_of_another_tokenizer_drafts_across_tokenizers_with_a_note(tiny_dir, foreign_draft_dir, capsys):
    common = ["--target", str(tiny_dir), "--prompt", "def add(a, b):"]
    plain, _ = generate_json(capsys, *common, "--draft", "none")
    crossed, err = generate_json(capsys, *common, "--draft", str(foreign_draft_dir), "--k", "3")
    assert "tokenizer of its own" in err and "cross-tokenizer" in err
    assert crossed["token_ids"] == plain["token_ids"] and crossed["stats"]["drafted_tokens"] > 0
    assert main([*GENERATE, *common, "--draft", str(foreign_draft_dir), "--drafter", "draft-model"]) == 2
    assert "different tokenizer" in capsys.readouterr().err  # named: refused, with the drafter to use


def test_the_server_serves_a_draft_of_another_tokenizer_across_tokenizers(tiny_dir, foreign_draft_dir):
    from verispec.serving.scheduler import build_scheduler

    scheduler = build_scheduler(
        str(tiny_dir), str(foreign_draft_dir), "composite", "float32", draft_quantize="none",
        foreign_draft_crosses=True,
    )
    assert scheduler.drafter == "cross-tokenizer"
    with pytest.raises(ValueError, match="different tokenizer"):
        build_scheduler(str(tiny_dir), str(foreign_draft_dir), "composite", "float32", draft_quantize="none")


def test_models_lists_cached_hub_causal_lms_with_their_architecture(tiny_on_hub, hub_cache, tmp_path, capsys,
                                                                    monkeypatch):
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    add_to_hub_cache(hub_cache, "org/bert", bert, MAIN_COMMIT)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    add_to_hub_cache(hub_cache, "org/gpt2", gpt2, MAIN_COMMIT)
    assert main(["models", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    hub = {model["repo_id"]: model for model in listing["hub"]}
    assert list(hub) == ["org/gpt2", "org/tiny"]  # the masked LM is left out
    assert hub["org/tiny"]["architecture"] == "qwen2" and hub["org/tiny"]["why_not"] is None
    assert hub["org/gpt2"]["architecture"] == "gpt2" and "'gpt2' is not supported" in hub["org/gpt2"]["why_not"]
    assert sorted(hub["org/tiny"]["refs"]) == ["main", "v1"]
    blobs = sum(f.stat().st_size for f in (hub_cache / "models--org--tiny" / "blobs").iterdir())
    assert hub["org/tiny"]["size_bytes"] == blobs
    assert listing["formats"]["none"]["runs"] and set(listing["formats"]) >= {"none", "w4a8", "w8a8", "int8", "int4"}
    monkeypatch.setenv("COLUMNS", "80")  # one line per model, and a line of its own for a reason
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "org/tiny" in out and "qwen2" in out and "org/bert" not in out and "weight formats that run here" in out
    assert "org/gpt2: verispec cannot run it: " in out and max(map(len, out.splitlines())) <= 80


def test_models_rm_frees_a_hub_model_and_refuses_an_unknown_name(tiny_on_hub, hub_cache, capsys):
    assert main(["models", "--rm", "org/tiny"]) == 0
    assert "freed" in capsys.readouterr().out
    assert not (hub_cache / "models--org--tiny").exists()
    assert main(["models", "--rm", "org/tiny"]) == 2
    err = capsys.readouterr().err
    assert "no model 'org/tiny' to remove" in err and "qwen2.5-coder-1.5b-instruct" in err and "Traceback" not in err


def test_models_shows_and_rm_frees_a_catalog_models_cache(hub_cache, own_cache, capsys):
    from verispec.models.catalog import DEFAULT_DRAFT

    converted = own_cache / DEFAULT_DRAFT
    converted.mkdir()
    (converted / "model.safetensors").write_bytes(b"\0" * 3000)
    (own_cache / "gguf").mkdir()
    (own_cache / "gguf" / f"{DEFAULT_DRAFT}.gguf").write_bytes(b"\0" * 1000)
    assert main(["models", "--json"]) == 0
    catalog = {model["name"]: model for model in json.loads(capsys.readouterr().out)["catalog"]}
    assert catalog[DEFAULT_DRAFT]["cache_bytes"] == 4000
    assert main(["models", "--rm", DEFAULT_DRAFT]) == 0
    assert "freed 3.9 KiB" in capsys.readouterr().out
    assert not converted.exists() and not (own_cache / "gguf" / f"{DEFAULT_DRAFT}.gguf").exists()
    assert os.listdir(own_cache / "gguf") == []


def test_an_uncached_hub_id_online_is_downloaded_quietly_with_only_what_verispec_reads(
    hub_cache, tiny_dir, tmp_path, monkeypatch
):
    """The cache is asked first, offline; then huggingface_hub downloads the model's config, tokenizer and
    safetensors only, its progress bars off unless asked for. A repo without safetensors weights is refused."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from verispec.models.hub import hub_snapshot

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    calls = []

    def fake_snapshot_download(repo_id, *, revision, cache_dir, local_files_only, tqdm_class, **patterns):
        calls.append((repo_id, local_files_only, tqdm_class))
        assert Path(cache_dir) == hub_cache and revision is None
        assert "*.safetensors" in patterns["allow_patterns"] and "config.json" in patterns["allow_patterns"]
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        bar = tqdm_class(total=1)
        assert bar.disable  # library code prints nothing
        source = tiny_dir if repo_id == "org/fresh" else no_weights
        return str(add_to_hub_cache(Path(cache_dir), repo_id, source, MAIN_COMMIT))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    snapshot = hub_snapshot("org/fresh")
    assert [(repo, local) for repo, local, _ in calls] == [("org/fresh", True), ("org/fresh", False)]
    assert (snapshot / "model.safetensors").exists()
    with pytest.raises(ValueError, match="holds no safetensors weights; verispec loads safetensors"):
        hub_snapshot("org/bin-only")
