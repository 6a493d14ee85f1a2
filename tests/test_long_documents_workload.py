"""benchmarks/workloads/long-documents.jsonl: 24 documents of 200-600 tokens, each with a question, an extraction
or a summary to do over it.

The shape is checked everywhere; the document lengths need the packaged target's tokenizer (only the tokenizer is
loaded, from the converted model directory), so that test is marked `real`.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from verispec.bench.workloads import load_workload

WORKLOAD = Path(__file__).resolve().parent.parent / "benchmarks" / "workloads" / "long-documents.jsonl"
TARGET = "qwen2.5-coder-1.5b-instruct"
KINDS = ("question", "extraction", "summary")


@pytest.fixture(scope="module")
def items():
    return load_workload(str(WORKLOAD))


def split(item: dict) -> tuple[str, str]:
    """(document, task): the user message's content before and after its last blank line."""
    document, separator, task = item["messages"][-1]["content"].rpartition("\n\n")
    assert separator, f"{item['id']}: no blank line between the document and the task"
    return document, task


def test_the_workload_has_24_items_with_unique_ids_of_each_kind(items):
    ids = [item["id"] for item in items]
    assert len(items) == 24
    assert len(set(ids)) == len(ids), [i for i, n in collections.Counter(ids).items() if n > 1]
    assert all(i.startswith("long-documents/") for i in ids)
    kinds = collections.Counter(i.removeprefix("long-documents/").split("-", 1)[0] for i in ids)
    assert set(kinds) == set(KINDS), kinds
    assert all(kinds[kind] >= 6 for kind in KINDS), kinds


def test_each_item_is_one_user_message_after_an_optional_system_message(items):
    for item in items:
        assert "prompt" not in item, item["id"]
        roles = [m["role"] for m in item["messages"]]
        assert roles in (["user"], ["system", "user"]), (item["id"], roles)
        document, task = split(item)
        assert document.strip() and task.strip(), item["id"]
        assert len(task) < len(document), f"{item['id']}: the task should follow the document, not hold it"


@pytest.mark.real
def test_each_document_is_200_to_600_tokens_of_the_target(items):
    from transformers import AutoTokenizer

    from verispec.models.loading import resolve_model

    _, directory, _ = resolve_model(TARGET)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    lengths = {item["id"]: len(tokenizer.encode(split(item)[0], add_special_tokens=False)) for item in items}
    outside = {i: n for i, n in lengths.items() if not 200 <= n <= 600}
    assert not outside, outside
    # spread over the range, not bunched at one length
    assert min(lengths.values()) < 300 and max(lengths.values()) > 500, lengths
