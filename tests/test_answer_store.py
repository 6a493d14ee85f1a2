"""The target's answers kept as token ids (benchmarks/draft_head/answer_store.py, issue 48): a kept set comes back as
it was written, a damaged one is refused, `study.py collect` teacher-forces a kept set instead of writing it again
and keeps each set it writes, and the standard library's code prompts are HumanEval's and code-edit's forms."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from conftest import benchmark_script


@pytest.fixture(scope="module")
def store_module():
    return benchmark_script("answer_store", folder="draft_head")


def collected_before(tmp_path, *names: str):
    """A work folder in which the eval sets, the first training sets and `names` were collected before (left as they
    are), and the store beside it."""
    work = tmp_path / "work"
    work.mkdir()
    for name in ("eval-humaneval", "eval-chat", "eval-code-edit", "train-humaneval", "train-code-edit", "train-text",
                 *names):
        torch.save([], work / f"{name}.pt")
    return work, tmp_path / "store"


def collect_args(work, store, **chosen) -> argparse.Namespace:
    """study.py collect's arguments: the first sets only, but for what `chosen` says."""
    return argparse.Namespace(**{
        "work": str(work), "threads": 1, "early_layers": [], "more": False, "self_chat": 0, "self_chat_more": 0,
        "stdlib_code": 0, "stdlib_skip": 0, "sampled_again": [], "store": str(store), "stored": False,
        "text_tokens": 0, "text_seed": 0} | chosen)


def test_a_kept_set_comes_back_as_written_and_a_damaged_one_is_refused(store_module, tmp_path):
    rows = [([5, 6, 7, 151_000, 9], 3), ([1, 2], 2), ([4, 3, 2, 1, 0, 8], 1)]
    path = tmp_path / "train-a.npz"
    store_module.save_answers(path, rows, {"machine": "zen4", "temperature": 0.7})
    assert store_module.load_answers(path) == (rows, {"machine": "zen4", "temperature": 0.7})
    assert store_module.stored_sets(tmp_path) == ["train-a"]

    with np.load(path) as kept:
        arrays = dict(kept)
    np.savez_compressed(path, **(arrays | {"ids": arrays["ids"][:-1]}))  # a token lost
    with pytest.raises(SystemExit, match="damaged"):
        store_module.load_answers(path)
    path.write_bytes(path.read_bytes()[:100])  # cut short
    with pytest.raises(SystemExit, match="damaged"):
        store_module.load_answers(path)


def test_stdlib_code_prompts_are_functions_to_complete_and_to_edit_in_a_fixed_order(store_module):
    completions, edits = store_module.stdlib_code_items(12)
    assert (completions, edits) == store_module.stdlib_code_items(12) and len(completions) == len(edits) == 12
    for item in completions:  # HumanEval's form: a def and its docstring, the body left to write
        compile(item["prompt"] + "    pass\n", item["id"], "exec")
        assert item["prompt"].startswith(("def ", "async def "))
    for item in edits:
        content = item["messages"][0]["content"]
        code = content.split("```python\n")[1].split("\n```")[0]
        compile(code, item["id"], "exec")  # a whole function
        assert any(edit in content for edit in store_module.STORED_EDITS)
    assert not {item["id"] for item in completions} & {item["id"].replace("stdlib-edit", "stdlib") for item in edits}
    longer = store_module.stdlib_code_items(17)  # a longer list starts with the same ones: batches do not overlap
    assert tuple(items[:12] for items in longer) == (completions, edits)
    later = store_module.stdlib_code_items(5, skip=12)  # a further batch: the next ones in the same order
    assert later == tuple(items[12:] for items in longer) and len(later[0]) == len(later[1]) == 5
    code = {item["prompt"] for item in completions} | {item["messages"][0]["content"] for item in edits}
    assert not code & ({item["prompt"] for item in later[0]} | {item["messages"][0]["content"] for item in later[1]})


def test_collect_teacher_forces_a_kept_set_and_keeps_a_set_it_writes(study, target, tmp_path, monkeypatch):
    work, store = collected_before(tmp_path)
    vocab = target.model.vocab_size
    generator = torch.Generator().manual_seed(4)
    kept = [(torch.randint(0, vocab, (n,), generator=generator).tolist(), start) for n, start in ((30, 12), (9, 4))]
    study.answer_store.save_answers(store / "train-chat.npz", kept, {"machine": "xeon"})
    study.answer_store.save_answers(store / "train-stdlib-edit.npz", kept[1:], {"machine": "zen2"})
    monkeypatch.setattr("verispec.models.loading.load_model", lambda *a, **k: target)

    def answers(loaded, prompts, temperature=0.0, max_tokens=128):
        assert False, "a kept set was written again"

    monkeypatch.setattr(study, "answers", answers)
    args = collect_args(work, store, stored=True)
    study.cmd_collect(args)
    for name, rows in (("train-chat", kept), ("train-stdlib-edit", kept[1:])):  # named by --stored only: the second
        tapped = torch.load(work / f"{name}.pt")
        assert [(row["ids"].tolist(), row["answer_start"]) for row in tapped] == rows
    row = tapped[0]
    with torch.no_grad():
        logits = target.model.forward(row["ids"][None], target.model.new_cache(1, len(row["ids"]) + 1))  # (1, T, V)
    assert torch.equal(row["argmax"], logits[0].argmax(-1))  # this machine's target labels the kept answers

    (work / "train-chat.pt").unlink()
    (store / "train-chat.npz").unlink()
    monkeypatch.setattr(study, "answers", lambda loaded, prompts, temperature=0.0: [[7, 8, 9]] * len(prompts))
    study.cmd_collect(collect_args(work, store))
    written, about = study.answer_store.load_answers(store / "train-chat.npz")
    assert len(written) == len(study.TRAIN_CHAT) and all(ids[start:] == [7, 8, 9] for ids, start in written)
    assert about["temperature"] == 0.0 and about["target"] == study.TARGET
    assert json.loads(json.dumps(about)) == about


def test_self_chat_more_asks_new_topics_and_leaves_out_the_first_rounds_and_measured_questions(
    study, target, tmp_path, monkeypatch
):
    from verispec.bench.workloads import load_workload

    work, store = collected_before(tmp_path, "train-chat")
    first_round = ["How do I reset my router to factory settings?"]
    (work / "self-chat-questions.json").write_text(json.dumps(first_round))
    measured = next(item["messages"][-1]["content"] for item in load_workload("chat")
                    if item["messages"][-1]["content"].endswith("?") and len(item["messages"][-1]["content"]) < 300)
    lists = "\n".join(["1. How do I reset my router to factory settings?", f"- {measured}",
                       "2. Which bank card is safest to use abroad?", "Why is my printer offline again?", "too short?"])
    asked = []

    def answers(loaded, prompts, temperature=0.0, max_tokens=128):
        if max_tokens == study.SELF_CHAT_LIST_TOKENS:  # the topic lists
            asked.extend(loaded.tokenizer.decode(ids) for ids in prompts)
            return [loaded.encode(lists)] * len(prompts)
        return [[7, 8, 9]] * len(prompts)

    monkeypatch.setattr(study, "answers", answers)
    monkeypatch.setattr("verispec.models.loading.load_model", lambda *a, **k: target)
    args = collect_args(work, store, self_chat_more=5)
    study.cmd_collect(args)
    assert len(asked) == len(study.SELF_CHAT_MORE_TOPICS)
    assert all(any(topic in ask for ask in asked) for topic in study.SELF_CHAT_MORE_TOPICS)
    assert not set(study.SELF_CHAT_MORE_TOPICS) & set(study.SELF_CHAT_TOPICS)
    questions = json.loads((work / "self-chat-more-questions.json").read_text())
    assert sorted(questions) == ["Which bank card is safest to use abroad?", "Why is my printer offline again?"]
    written, _ = study.answer_store.load_answers(store / "train-chat-self-more.npz")
    prompts = [target.tokenizer.decode(ids[:start]) for ids, start in written]
    assert len(prompts) == 2 and all(any(q in prompt for prompt in prompts) for q in questions)
    assert len(torch.load(work / "train-chat-self-more.pt")) == 2

    # On a machine that has only the kept answers, the same command writes no questions: it teacher-forces them.
    for name in ("train-chat-self-more.pt", "self-chat-more-questions.json", "self-chat-questions.json"):
        (work / name).unlink()
    asked.clear()
    study.cmd_collect(args)
    assert asked == [] and not (work / "self-chat-more-questions.json").exists()
    tapped = torch.load(work / "train-chat-self-more.pt")
    assert [(row["ids"].tolist(), row["answer_start"]) for row in tapped] == written


def test_sampled_again_answers_a_kept_sets_prompts_once_more_sampled_and_refuses_an_unknown_set(
    study, target, tmp_path, monkeypatch
):
    work, store = collected_before(tmp_path, "train-chat")
    kept = [([11, 12, 13, 14, 15], 3), ([21, 22, 23], 2)]
    study.answer_store.save_answers(store / "train-chat-self.npz", kept, {"machine": "zen4", "temperature": 0.0})
    asked = []

    def answers(loaded, prompts, temperature=0.0, max_tokens=128):
        asked.append((prompts, temperature))
        return [[7, 8, 9 + i] for i in range(len(prompts))]

    monkeypatch.setattr(study, "answers", answers)
    monkeypatch.setattr("verispec.models.loading.load_model", lambda *a, **k: target)
    args = collect_args(work, store, sampled_again=["train-chat-self"])
    study.cmd_collect(args)
    assert asked == [([[11, 12, 13], [21, 22]], study.SAMPLED_TEMPERATURE)]  # the kept prompts, not their answers
    written, about = study.answer_store.load_answers(store / "train-chat-self-sampled.npz")
    assert written == [([11, 12, 13, 7, 8, 9], 3), ([21, 22, 7, 8, 10], 2)]
    assert about["temperature"] == study.SAMPLED_TEMPERATURE
    assert len(torch.load(work / "train-chat-self-sampled.pt")) == 2
    assert not (work / "train-chat-self.pt").exists()  # the set it answers again is only read

    asked.clear()  # written once: kept, and not asked again
    (work / "train-chat-self-sampled.pt").unlink()
    study.cmd_collect(args)
    assert asked == [] and len(torch.load(work / "train-chat-self-sampled.pt")) == 2
    for unknown in ("train-chat-never-kept", "eval-chat"):
        with pytest.raises(SystemExit, match=f"--sampled-again {unknown}: not a kept training set.*train-chat-self"):
            study.cmd_collect(collect_args(work, store, sampled_again=[unknown]))
