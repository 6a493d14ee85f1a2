"""The command line, in-process: JSON output, plain vs speculative equality, clear errors."""

from __future__ import annotations

import json

from conftest import FAST_FORMAT
from verispec.cli import main


def run_json(capsys, *args):
    assert main(["generate", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_speculative_equals_plain(capsys, tiny_dir, other_tiny_dir):
    common = ["--target", str(tiny_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--dtype", "float32"]
    plain = run_json(capsys, *common, "--draft", "none")
    spec = run_json(capsys, *common, "--draft", str(other_tiny_dir), "--k", "3")
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["text"] == plain["text"]
    for key in ("target_forwards", "draft_forwards", "drafted_tokens", "accepted_tokens", "acceptance_rate",
                "mean_tokens_per_target_forward", "acceptance_by_position", "prefill_seconds", "draft_seconds",
                "verify_seconds", "tokens_per_second"):
        assert key in spec["stats"]
    assert spec["stats"]["drafted_tokens"] > 0 and plain["stats"]["drafted_tokens"] == 0


def test_generate_with_a_json_schema_and_penalties(capsys, tiny_dir, other_tiny_dir, tmp_path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps({"enum": ["add", "def", "class"]}))
    common = ["--target", str(tiny_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--dtype", "float32",
              "--json-schema", str(schema_file), "--frequency-penalty", "0.5", "--repetition-penalty", "1.2"]
    plain = run_json(capsys, *common, "--draft", "none")
    spec = run_json(capsys, *common, "--draft", str(other_tiny_dir), "--k", "3")
    assert spec["token_ids"] == plain["token_ids"] and json.loads(plain["text"]) in ("add", "def", "class")
    schema_file.write_text("{not json")
    assert main(["generate", *common, "--draft", "none"]) == 2
    assert "--json-schema" in capsys.readouterr().err
    assert main(["generate", "--target", str(tiny_dir), "--prompt", "x", "--presence-penalty", "3"]) == 2
    assert "presence_penalty" in capsys.readouterr().err


def test_streamed_text_equals_json_text(capsys, tiny_dir, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("class")
    common = ["--target", str(tiny_dir), "--draft", str(tiny_dir), "--prompt-file", str(prompt_file),
              "--max-new-tokens", "16", "--temperature", "0.8", "--seed", "3", "--k", "3"]
    data = run_json(capsys, *common)
    assert main(["generate", *common]) == 0
    captured = capsys.readouterr()
    assert captured.out == data["text"] + "\n"
    assert "tok/s" in captured.err


def test_chat_template(capsys, tiny_dir):
    data = run_json(capsys, "--target", str(tiny_dir), "--draft", "none", "--prompt", "hi", "--chat",
                    "--max-new-tokens", "4")
    assert data["stats"]["prompt_tokens"] > 1


def test_errors_are_messages_not_tracebacks(capsys, tiny_dir):
    assert main(["generate", "--target", "no-such-model", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "neither a catalog name" in err and "Traceback" not in err
    assert main(["generate", "--target", str(tiny_dir), "--draft", "none", "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_models_lists_the_catalog(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b-instruct" in out and "smollm2-135m-instruct" in out


def test_models_fits_an_80_column_terminal(capsys, monkeypatch):
    """Its tables fold cell by cell at 80 columns: there each model gets one line, and the notes wrap to fit."""
    from verispec.models.catalog import CATALOG

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80, lines
    for name in CATALOG:
        assert any(line.startswith(name + " ") for line in lines), (name, lines)


def test_generate_reports_the_target_format_and_fast_format_speculation_is_exact(capsys, tiny_dir, other_tiny_dir):
    common = ["--target", str(tiny_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "24",
              "--dtype", "bfloat16", "--quantize", FAST_FORMAT]
    plain = run_json(capsys, *common, "--draft", "none")
    spec = run_json(capsys, *common, "--draft", str(other_tiny_dir), "--k", "3")
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["target_format"]["format"].startswith(FAST_FORMAT) and spec["target_format"]["batch_invariant"]
    dense = run_json(capsys, "--target", str(tiny_dir), "--prompt", "x", "--draft", "none", "--dtype", "float32")
    assert dense["target_format"]["format"] == "none"  # auto keeps an explicit float32 exact


def test_models_says_where_auto_quantization_is_decided(capsys):
    assert main(["models"]) == 0
    assert "--quantize auto: a target's format is timed at its first load" in capsys.readouterr().out
