"""`verispec bench` end to end on tiny models, and its workloads."""

from __future__ import annotations

import json

import pytest

from verispec.bench.runner import bootstrap_ci
from verispec.bench.workloads import load_workload
from verispec.cli import main


def test_named_workloads():
    humaneval = load_workload("humaneval")
    assert len(humaneval) == 164 and humaneval[0]["id"] == "HumanEval/0"
    edits = load_workload("code-edit", limit=3)
    assert len(edits) == 3
    assert all("```python" in e["messages"][0]["content"] for e in edits)
    assert "def has_close_elements" in edits[0]["messages"][0]["content"]
    chat = load_workload("chat")
    assert len(chat) >= 10 and all(c["messages"][0]["role"] == "user" for c in chat)


def test_user_jsonl_workload(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "def f():"}\n\n{"id": "x", "messages": [{"role": "user", "content": "hi"}]}\n')
    prompts = load_workload(str(path))
    assert prompts == [{"id": "mine/1", "prompt": "def f():"}, {"id": "x", "messages": [{"role": "user", "content": "hi"}]}]


@pytest.mark.parametrize(
    "content, message",
    [("{not json\n", "not valid JSON"), ('{"text": "x"}\n', '"prompt"'), ("", "no prompts"),
     ('{"messages": [{"role": "user"}]}\n', '"content"')],
)
def test_bad_jsonl_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_workload(str(path))


def test_unknown_workload(tmp_path):
    with pytest.raises(FileNotFoundError, match="humaneval"):
        load_workload("no-such-workload")


def test_bootstrap_interval_brackets_the_geomean():
    low, high = bootstrap_ci([1.5, 2.0, 2.5, 1.8, 2.2])
    assert low < 2.0 < high


def test_bench_end_to_end_on_tiny_models(tmp_path, tiny_dir, other_tiny_dir, capsys):
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt": "def add(a, b):"}\n{"messages": [{"role": "user", "content": "hello"}]}\n')
    out = tmp_path / "out"
    code = main([
        "bench", "--target", str(tiny_dir), "--draft", str(other_tiny_dir), "--workload", str(workload),
        "--modes", "plain,spec,hf-plain,hf-assisted", "--k", "2,4", "--max-new-tokens", "12",
        "--dtype", "float32", "--out", str(out),
    ])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    modes = [s["mode"] for s in results["summary"]]
    assert modes == ["plain", "spec-k2", "spec-k4", "hf-plain", "hf-assisted", "hf-assisted-k2", "hf-assisted-k4"]
    report = (out / "report.md").read_text()
    for summary in results["summary"]:
        assert f"{summary['tokens_per_second']:.2f}" in report  # the report shows the numbers in results.json
    for name in ("speedup_by_mode.png", "tokens_per_second_per_prompt.png", "acceptance_by_position.png", "speedup_vs_k.png"):
        assert (out / name).stat().st_size > 1000
    by_mode = {s["mode"]: s for s in results["summary"]}
    assert by_mode["spec-k2"]["identical_to_baseline"] == 1.0  # greedy speculative == plain
    assert by_mode["hf-plain"]["identical_to_baseline"] == 1.0  # our model code matches transformers
    assert len(by_mode["spec-k4"]["acceptance_by_position"]) == 4
    assert len(results["prompts"]) == 2 and results["command"].startswith("verispec bench")
    assert "plain" in capsys.readouterr().out


def test_bench_rejects_bad_arguments(capsys, tiny_dir):
    with pytest.raises(SystemExit):
        main(["bench", "--target", str(tiny_dir), "--modes", "plain,warp"])
    assert "unknown mode" in capsys.readouterr().err
    assert main(["bench", "--target", str(tiny_dir), "--workload", "nope"]) == 2
