"""Every supported architecture against transformers' own implementation, on tiny random models built here.

Each model is built from its transformers config class (a few layers, a sliding window shorter than the test's
sequences, soft-capping and scaled rotary embeddings where the architecture has them) and saved as a safetensors
directory. verispec must give transformers' logits (float32), its greedy tokens in plain and speculative decoding,
in the library and the server; and in the default fast format greedy speculative == plain, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from conftest import FAST_FORMAT, build_tokenizer
from verispec.drafters import DraftModelDrafter
from verispec.engine import GenerationConfig, SpeculativeEngine
from verispec.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from verispec.models.loading import load_model
from verispec.serving.app import create_app
from verispec.serving.guard import ServerSettings
from verispec.serving.metrics import ServerMetrics
from verispec.serving.scheduler import Scheduler, SchedulerLimits

WINDOW = 8  # sliding layers see this many positions: the prompts and outputs below are longer
SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# name -> (transformers config class, its arguments): each switch of verispec.models.config in at least one.
ARCHITECTURES = {
    "llama3": ("LlamaConfig", dict(num_hidden_layers=2, max_position_embeddings=512, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, max_position_embeddings=512, sliding_window=WINDOW)),
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2, max_position_embeddings=512, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128})),
    "qwen3-sliding": ("Qwen3Config", dict(num_hidden_layers=3, max_position_embeddings=512, use_sliding_window=True,
                                          sliding_window=WINDOW, max_window_layers=1)),
    "gemma": ("GemmaConfig", dict(num_hidden_layers=3, max_position_embeddings=512)),
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=3, max_position_embeddings=512, sliding_window=WINDOW,
                                    query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, max_position_embeddings=512, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})),
    "phi3": ("Phi3Config", dict(num_hidden_layers=2, max_position_embeddings=512, sliding_window=WINDOW,
                                partial_rotary_factor=0.5, original_max_position_embeddings=128,
                                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.5,
                                                 "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                 "long_factor": [4.0, 8.0, 16.0, 32.0]})),
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, max_position_embeddings=512, no_rope_layers=[1, 1, 1, 0])),
}
PROMPT = "def add(a, b):\n    return a + b\n\nclass Point:\n"
NEW_TOKENS = 24


def build_architecture(directory: Path, name: str, seed: int, scale: float = 3.0) -> Path:
    """A random-weight model of architecture `name` with the tests' small tokenizer, as a safetensors directory."""
    import transformers

    class_name, arguments = ARCHITECTURES[name]
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    config = getattr(transformers, class_name)(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, **SHAPE, **arguments,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # default init is too flat to give interesting distributions
        for parameter in model.parameters():
            if parameter.abs().max() == 0:  # Gemma's norm weights (it scales by 1 + w)
                parameter.normal_(0.0, 0.5)
            parameter.mul_(scale)
        if name.startswith("gemma"):  # it multiplies embeddings by sqrt(C): they would drown every layer's output
            model.get_input_embeddings().weight.div_(config.hidden_size**0.5)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def architecture(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(name, target directory, draft directory: the same architecture with other weights)."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    return name, build_architecture(root / "target", name, seed=0), build_architecture(root / "draft", name, seed=1)


def transformers_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")


def transformers_greedy(directory: Path, ids: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of ids (each step recomputed from scratch) and its logits over ids."""
    model = transformers_model(directory)
    tokens = list(ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]  # (T, V)
        for _ in range(new_tokens):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(ids):], logits


def greedy(k: int | str = 0) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW_TOKENS, k=k, eos_token_ids=())  # no eos: full-length outputs


def test_every_architecture_here_is_a_supported_model_type():
    import transformers

    for class_name, _ in ARCHITECTURES.values():
        assert getattr(transformers, class_name).model_type in SUPPORTED_MODEL_TYPES


def test_float32_logits_and_greedy_tokens_are_transformers(architecture):
    name, directory, draft_directory = architecture
    target = load_model(directory, "float32")
    ids = target.encode(PROMPT)
    assert len(ids) + NEW_TOKENS > 2 * WINDOW  # the windows cut in
    expected_tokens, expected_logits = transformers_greedy(directory, ids, NEW_TOKENS)
    cache = target.model.new_cache(1, len(ids) + 4)
    logits = target.model.forward(torch.tensor([ids]), cache)[0]  # (T, V)
    assert torch.allclose(logits, expected_logits, atol=1e-4, rtol=1e-4), (logits - expected_logits).abs().max()
    long_ids = torch.randint(0, target.model.vocab_size, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # a pass longer than INVARIANT_ATTENTION_MAX_ROWS: one masked attention call a layer
        expected_long = transformers_model(directory)(long_ids).logits[0]  # (T, V)
    long_logits = target.model.forward(long_ids, target.model.new_cache(1, 84))[0]  # (T, V)
    assert torch.allclose(long_logits, expected_long, atol=1e-4, rtol=1e-4), (long_logits - expected_long).abs().max()
    plain = SpeculativeEngine(target).generate(PROMPT, greedy())
    assert plain.token_ids == expected_tokens
    assert len(set(expected_tokens)) > 4  # a text, not one token repeated
    draft = load_model(draft_directory, "float32")
    for drafter_model, k in [(target.model, 3), (draft.model, 2)]:  # every draft accepted / mostly rejected
        speculative = SpeculativeEngine(target, DraftModelDrafter(drafter_model, target.model.vocab_size))
        result = speculative.generate(PROMPT, greedy(k))
        assert result.token_ids == expected_tokens
        assert result.stats.drafted_tokens > 0
    assert result.stats.acceptance_rate < 1.0  # the other weights' drafts were checked, not waved through


def test_fast_format_speculative_equals_plain_bit_for_bit(architecture):
    name, directory, draft_directory = architecture
    target = load_model(directory, "bfloat16", quantize=FAST_FORMAT)
    assert target.model.batch_invariant
    draft = load_model(draft_directory, "bfloat16", quantize=FAST_FORMAT)
    plain = SpeculativeEngine(target).generate(PROMPT, greedy())
    for drafter_model in (target.model, draft.model):
        speculative = SpeculativeEngine(target, DraftModelDrafter(drafter_model, target.model.vocab_size))
        assert speculative.generate(PROMPT, greedy(3)).token_ids == plain.token_ids


@pytest.mark.parametrize("dtype, quantize", [("float32", "none"), ("bfloat16", FAST_FORMAT)])
def test_served_greedy_equals_the_library(architecture, dtype, quantize):
    """Three requests at once through the server's batched step (draft model, k = 3): each is plain decoding."""
    name, directory, draft_directory = architecture
    target = load_model(directory, dtype, quantize=quantize)
    draft = load_model(draft_directory, dtype, quantize=quantize)
    prompts = [PROMPT, "for i in range(10):\n", "The quick brown fox"]
    expected = [SpeculativeEngine(target).generate(prompt, greedy()).text for prompt in prompts]
    limits = SchedulerLimits(max_batch_size=4, max_context=128)  # (phi3's longrope context is 128)
    scheduler = Scheduler(target, draft.model, "draft-model", k=3, limits=limits)
    scheduler.start()
    try:
        with TestClient(create_app(scheduler, ServerMetrics(), ServerSettings("tiny"))) as http:
            import concurrent.futures

            def complete(prompt: str) -> dict:
                body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
                return http.post("/v1/completions", json=body).json()

            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                responses = list(pool.map(complete, prompts))
    finally:
        scheduler.stop()
    assert [response["choices"][0]["text"] for response in responses] == expected
    assert sum(response["speculative"]["drafted_tokens"] for response in responses) > 0


def test_an_unsupported_architecture_or_rope_is_refused_by_name():
    with pytest.raises(ValueError, match="'gpt2' is not supported.*qwen3.*gemma2.*phi3"):
        ModelConfig.from_hf_dict({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="multimodal Gemma 3"):
        ModelConfig.from_hf_dict({"model_type": "gemma3"})
    llama = dict(model_type="llama", vocab_size=100, num_hidden_layers=1, **SHAPE)
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        ModelConfig.from_hf_dict(llama | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


def test_legacy_config_fields_read_as_transformers_reads_them():
    """A Llama 3.2 config.json as published (rope_scaling, rope_theta at the top) and Phi-4-mini's longrope."""
    llama = ModelConfig.from_hf_dict(dict(
        model_type="llama", vocab_size=100, num_hidden_layers=1, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, **SHAPE))
    assert llama.rope_theta == 500000.0 and llama.max_position_embeddings == 131072
    [(kind, rope)] = llama.ropes
    assert len(rope.inv_freq) == 8 and rope.inv_freq[0] == 1.0 and rope.inv_freq[-1] < 500000.0 ** (-14 / 16)
    phi = ModelConfig.from_hf_dict(dict(
        model_type="phi3", vocab_size=100, num_hidden_layers=1, partial_rotary_factor=0.75, rope_theta=10000.0,
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}, **SHAPE))
    assert phi.rotary_dim == 12 and phi.fused_projections
    assert phi.max_position_embeddings == 4096  # the short factors' reach: longer contexts are refused
    assert phi.ropes[0][1].attention_scaling > 1.0


def test_without_verispec_kernels_step_by_step_logits_are_transformers(architecture, monkeypatch):
    """torch's attention one query at a time (machines where the kernels do not build), a token per forward."""
    from verispec.models import attention, transformer

    monkeypatch.setattr(attention, "attention_kernel_runs", lambda head_dim, dtype: False)
    monkeypatch.setattr(transformer, "norm_kernel_runs", lambda x: False)
    name, directory, _ = architecture
    model = load_model(directory, "float32").model
    ids = torch.randint(0, model.vocab_size, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = transformers_model(directory)(ids).logits[0]  # (T, V)
    cache = model.new_cache(1, ids.shape[1])
    steps = []
    for position in range(ids.shape[1]):
        steps.append(model.forward(ids[:, position : position + 1], cache)[0, 0])  # (V,)
        cache.commit(1)
    assert torch.allclose(torch.stack(steps), expected, atol=1e-4, rtol=1e-4)
