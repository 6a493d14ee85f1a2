"""Architecture hyper-parameters of a decoder-only transformer (Llama / Qwen2 / Mistral family)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int  # rows of the embedding and of the output projection
    hidden_size: int  # C: width of the residual stream
    intermediate_size: int  # width of the SwiGLU MLP
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention when < num_heads)
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool  # Qwen2 has biases on the q, k and v projections; Llama does not
    tie_word_embeddings: bool  # output projection shares the embedding matrix
    max_position_embeddings: int
    model_type: str

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "ModelConfig":
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; verispec runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} architectures"
            )
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ValueError(f"rope scaling {rope_type!r} is not supported yet")
        num_heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            model_type=model_type,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        return cls.from_hf_dict(json.loads((Path(model_dir) / "config.json").read_text()))
