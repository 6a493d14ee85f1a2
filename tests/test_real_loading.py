"""The packaged models through the command line and in other dtypes: loaded on their own, not beside the float32
pair of test_real_models (a worker holding both went past 20 GiB and was killed on a 24 GiB machine)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import real_thread_count
from verispec import GenerationConfig, SpeculativeEngine, load_draft_model, load_model
from verispec.bench.workloads import humaneval as humaneval_prompts
from verispec.cli import main

pytestmark = pytest.mark.real

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module", autouse=True)
def module_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(real_thread_count())  # for loading; each test: real_threads
    yield
    torch.set_num_threads(previous)


def test_cli_json_speculative_equals_plain(capsys):
    """The CLI's defaults (the fast batch-invariant target, its cached quantized weights: little memory beside
    a parallel suite's other real models): speculative output equals plain, token for token."""
    prompt = 'def count_vowels(text: str) -> int:\n    """Count the vowels in text."""\n'
    common = ["generate", "--json", "--target", TARGET, "--prompt", prompt, "--max-new-tokens", "32"]
    assert main([*common, "--draft", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*common, "--draft", DRAFT, "--k", "4"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["stats"]["mean_tokens_per_target_forward"] > 1.5


def test_bfloat16_int4_drafter_is_lossless_against_bf16_plain():
    """Quantizing the draft changes acceptance only; the bf16 target decides every token."""
    target = load_model(TARGET, "bfloat16")
    drafter = load_draft_model(DRAFT, target, "bfloat16", quantize="int4")
    prompt = humaneval_prompts()[0]["prompt"]
    result = SpeculativeEngine(target, drafter).generate(prompt, GenerationConfig(max_new_tokens=24, k=4))
    assert result.stats.acceptance_rate > 0.5
    assert len(result.token_ids) == 24


def test_smollm2_loads_from_its_package_and_refuses_to_draft_for_qwen():
    smol = load_model("smollm2-135m-instruct", "float32")
    text = SpeculativeEngine(smol).generate(smol.apply_chat_template("What is 2+2?"), GenerationConfig(max_new_tokens=12, k=0)).text
    assert "4" in text
    qwen = load_model(DRAFT, "float32")
    with pytest.raises(ValueError, match="different tokenizer"):
        load_draft_model("smollm2-135m-instruct", qwen, "float32")
