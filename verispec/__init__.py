"""verispec: lossless speculative decoding.

    from verispec import load_model, load_draft_model, SpeculativeEngine, GenerationConfig
    target = load_model("qwen2.5-coder-1.5b-instruct")
    drafter = load_draft_model("qwen2.5-coder-0.5b-instruct", target)
    result = SpeculativeEngine(target, drafter).generate("def fib(n):", GenerationConfig(max_new_tokens=64))
"""

from verispec.drafters import load_draft_model
from verispec.engine import GenerationConfig, GenerationResult, SpeculativeEngine
from verispec.models.loading import LoadedModel, load_model
from verispec.sampling import SamplingParams
from verispec.stats import GenerationStats

__all__ = [
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "LoadedModel",
    "SamplingParams",
    "SpeculativeEngine",
    "load_draft_model",
    "load_model",
]
