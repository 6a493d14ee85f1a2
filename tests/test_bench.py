"""`verispec bench` end to end on tiny models, and its workloads."""

from __future__ import annotations

import json

import pytest

from conftest import FAST_FORMAT
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
    assert "commit" in results and results["machine_kind"]  # where it came from (benchmarks/results/<kind>/)
    choices = results["choices"]  # what the run chose by itself, printed under the table too
    assert choices["modes"]["spec-k2"] == {"drafter": "draft model", "k": 2} and "hf-plain" not in choices["modes"]
    assert choices["targets"][0]["format"] == "none"
    printed = capsys.readouterr().out
    assert "plain" in printed and "spec-k4: drafter draft model, k 4" in printed


@pytest.mark.parametrize("columns", [80, 200])
def test_bench_prints_one_line_per_mode_where_its_table_would_fold(tmp_path, tiny_dir, other_tiny_dir, capsys,
                                                                   monkeypatch, columns):
    """An 80-column terminal or a pipe folds the whole table inside its cells ("plai" over "n"): there each mode gets
    one line that fits, with its speedup; a terminal wide enough gets the table itself."""
    monkeypatch.setenv("COLUMNS", str(columns))
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt": "def add(a, b):"}\n')
    out = tmp_path / "out"
    code = main([
        "bench", "--target", str(tiny_dir), "--draft", str(other_tiny_dir), "--workload", str(workload),
        "--modes", "plain,spec,composite", "--k", "2,auto", "--max-new-tokens", "8", "--dtype", "float32",
        "--out", str(out),
    ])
    assert code == 0
    printed = capsys.readouterr()
    lines = (printed.out + printed.err).splitlines()
    assert max(map(len, lines)) <= columns, printed.out
    summaries = json.loads((out / "results.json").read_text())["summary"]
    assert [s["mode"] for s in summaries] == ["plain", "spec-k2", "spec-auto", "composite-k2", "composite-auto"]
    for summary in summaries:
        speedup = f"{summary['speedup_geomean']:.2f}x"
        assert any(summary["mode"] in line and speedup in line for line in lines), (summary["mode"], printed.out)
    assert ("speedup (geomean, 95% CI)" in printed.out) == (columns == 200)  # the full table where it fits


def test_bench_rejects_bad_arguments(capsys, tiny_dir):
    with pytest.raises(SystemExit):
        main(["bench", "--target", str(tiny_dir), "--modes", "plain,warp"])
    assert "unknown mode" in capsys.readouterr().err
    assert main(["bench", "--target", str(tiny_dir), "--workload", "nope"]) == 2


def test_pass_at_1_runs_each_completion_against_its_tests():
    from verispec.bench.checks import completion_of, pass_at_1, passes

    problem = {"id": "t/0", "prompt": "def double(x):\n", "entry_point": "double",
               "test": "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(-1) == -2\n"}
    assert completion_of("    return 2 * x\n\ndef other():\n    pass\n") == "    return 2 * x\n"
    assert completion_of("    return x\n# trailing\n") == "    return x"
    assert passes(problem, "    return 2 * x\n")
    assert not passes(problem, "    return x + 2\n")  # right on 2, wrong on -1: the tests decide
    assert not passes(problem, "    while True:\n        pass\n", timeout=1.0)  # a hang times out, not the bench
    scores = pass_at_1([problem, {**problem, "id": "t/1"}], {"good": ["    return x * 2", "    return x + x"],
                                                              "bad": ["    return x", "    return 0"]})
    assert scores["good"]["pass_at_1"] == 1.0 and scores["bad"]["pass_at_1"] == 0.0
    assert scores["good"]["passed"] == ["t/0", "t/1"]


def test_bench_check_pass_at_1_with_two_target_formats(tmp_path, tiny_dir, other_tiny_dir):
    workload = tmp_path / "w.jsonl"
    line = {"prompt": "def double(x):\n", "entry_point": "double",
            "test": "def check(candidate):\n    assert candidate(2) == 4\n"}
    workload.write_text(json.dumps(line) + "\n" + json.dumps({**line, "id": "second"}) + "\n")
    out = tmp_path / "out"
    code = main([
        "bench", "--target", str(tiny_dir), "--draft", str(other_tiny_dir), "--workload", str(workload),
        "--modes", "plain,spec", "--k", "3", "--max-new-tokens", "12", "--dtype", "bfloat16",
        "--quantize", f"none,{FAST_FORMAT}", "--check", "pass@1", "--out", str(out),
    ])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    by_mode = {s["mode"]: s for s in results["summary"]}
    assert set(by_mode) == {"plain[none]", "spec-k3[none]", f"plain[{results['target_formats'][1]['format']}]",
                            f"spec-k3[{results['target_formats'][1]['format']}]"}
    assert all(s["pass_at_1"] == 0.0 for s in by_mode.values())  # random tiny models write no working code
    fast = [s for name, s in by_mode.items() if FAST_FORMAT in name]
    assert fast[0]["tokens_per_second"] > 0 and results["baseline"] == "plain[none]"
    assert "pass@1" in (out / "report.md").read_text()


def test_bench_check_needs_tests_in_the_workload(capsys, tiny_dir):
    assert main(["bench", "--target", str(tiny_dir), "--workload", "chat", "--check", "pass@1"]) == 2
    assert "entry_point" in capsys.readouterr().err


def test_bench_structured_output_with_and_without_schema(tmp_path, tiny_dir):
    """--schema both: every mode runs free and constrained; constrained outputs all validate, and each
    family is compared with its own plain (greedy spec == plain under the schema too)."""
    schema = {"type": "array", "items": {"enum": ["add", "def"]}, "maxItems": 2}
    workload = tmp_path / "w.jsonl"
    lines = [{"prompt": "def add(a, b):\n", "json_schema": schema},
             {"messages": [{"role": "user", "content": "list two words"}], "json_schema": schema},
             {"prompt": "no schema here"}]
    workload.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    code = main([
        "bench", "--target", str(tiny_dir), "--workload", str(workload), "--modes", "plain,lookup",
        "--k", "3", "--max-new-tokens", "24", "--dtype", "float32", "--schema", "both", "--out", str(out),
    ])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    by_mode = {s["mode"]: s for s in results["summary"]}
    assert list(by_mode) == ["plain", "lookup-k3", "plain+schema", "lookup-k3+schema"]
    assert results["baselines"] == {"plain": "plain", "lookup-k3": "plain",
                                    "plain+schema": "plain+schema", "lookup-k3+schema": "plain+schema"}
    assert by_mode["plain+schema"]["schema_valid"] == 1.0 and by_mode["lookup-k3+schema"]["schema_valid"] == 1.0
    assert by_mode["plain"]["schema_valid"] < 1.0  # random weights, unconstrained: no valid documents
    assert all(s["identical_to_baseline"] == 1.0 for s in by_mode.values())
    constrained, free = (results["prompts"][0]["runs"][name]["token_ids"] for name in ("plain+schema", "plain"))
    assert constrained != free
    report = (out / "report.md").read_text()
    assert "| schema-valid |" in report and "| plain+schema |" in report and "against `plain+schema`" in report


def test_bench_schema_errors(tmp_path, tiny_dir, capsys):
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "x"}\n')
    assert main(["bench", "--target", str(tiny_dir), "--workload", str(plain), "--schema", "both"]) == 2
    assert "json_schema" in capsys.readouterr().err
    schemas = tmp_path / "schemas.jsonl"
    schemas.write_text('{"prompt": "x", "json_schema": {"type": "integer"}}\n')
    assert main(["bench", "--target", str(tiny_dir), "--workload", str(schemas), "--modes", "plain,hf-plain"]) == 2
    assert "--schema off" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "json_schema": "object"}\n')
    with pytest.raises(ValueError, match="JSON Schema object"):
        load_workload(str(bad))
