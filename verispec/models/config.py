"""Architecture hyper-parameters of a decoder-only transformer.

One dataclass describes every supported layout: the Llama skeleton (pre-norm, rotary attention, gated MLP)
plus the switches by which Qwen3, Gemma 2/3, Phi-3 and SmolLM3 differ from it. A Hugging Face config.json
is read through transformers' own config class, so legacy fields (`rope_scaling`, `rope_theta`) and
defaults (`layer_types`) come out as transformers itself uses them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# model_type -> the checkpoints people know it by (for messages and the README).
ARCHITECTURES = {
    "llama": "Llama 2, Llama 3.x (rope type llama3), TinyLlama",
    "mistral": "Mistral 7B",
    "qwen2": "Qwen2, Qwen2.5",
    "qwen3": "Qwen3 (dense)",
    "gemma": "Gemma",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 text-only (1B, 270M)",
    "phi3": "Phi-3, Phi-3.5-mini, Phi-4-mini",
    "smollm3": "SmolLM3",
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
# Rotary variants whose frequencies do not change with the sequence length (longrope: its short factors, see below).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class Rope:
    """Rotary frequencies of one kind of layer: inv_freq (rotary_dim / 2 values) and the factor on cos and sin."""

    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int  # rows of the embedding and of the output projection
    hidden_size: int  # C: width of the residual stream
    intermediate_size: int  # width of the gated MLP
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
    hidden_act: str = "silu"  # the MLP's gate activation (ACTIVATIONS)
    norm_plus_one: bool = False  # Gemma's norms scale by (1 + w)
    sandwich_norms: bool = False  # Gemma 2/3: the attention and MLP outputs are normed too, before the residual add
    qk_norm: bool = False  # Qwen3, Gemma 3: each head's q and k are RMS-normed before the rotary embedding
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(C)
    attention_scale: float | None = None  # softmax scale when not head_dim ** -0.5 (Gemma's query_pre_attn_scalar)
    attn_softcap: float | None = None  # Gemma 2: scores become cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits likewise
    sliding_window: int | None = None  # a sliding layer's query sees this many positions, itself included
    layer_types: tuple[str, ...] = ()  # per layer FULL or SLIDING; () = all FULL
    no_rope_layers: tuple[int, ...] = ()  # SmolLM3: layers that take no rotary embedding
    rotary_dim: int | None = None  # leading dims of each head that rotate (Phi-4-mini: 3/4); None = head_dim
    ropes: tuple[tuple[str, Rope], ...] = ()  # layer type -> its rotary frequencies; () = default from rope_theta
    fused_projections: bool = False  # Phi-3 stores qkv_proj and gate_up_proj as one matrix each

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, None for a layer that sees its whole context."""
        if self.sliding_window is None:
            return None
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def rope_kind(self, layer: int) -> str | None:
        """Which of `ropes` rotates `layer`'s q and k (None: no rotary embedding)."""
        if layer in self.no_rope_layers:
            return None
        if len(self.ropes) > 1 and self.layer_types:
            return self.layer_types[layer]
        return FULL

    def rope_of(self, kind: str) -> Rope:
        for name, rope in self.ropes:
            if name == kind:
                return rope
        dim = self.rotary_dim or self.head_dim
        return Rope(tuple((1.0 / (self.rope_theta ** (i / dim))) for i in range(0, dim, 2)))

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "ModelConfig":
        model_type = hf.get("model_type", "")
        if model_type == "gemma3":
            raise ValueError(
                "multimodal Gemma 3 checkpoints (model_type 'gemma3') are not supported; the text-only ones "
                "(model_type 'gemma3_text': gemma-3-1b, gemma-3-270m) are"
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            supported = "; ".join(f"{name} ({models})" for name, models in ARCHITECTURES.items())
            raise ValueError(f"model_type {model_type!r} is not supported; verispec runs {supported}")
        config = _transformers_config(hf)
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        rope_parameters = config.rope_parameters or {}
        per_layer_type = all(isinstance(value, dict) for value in rope_parameters.values()) and rope_parameters
        rope_by_kind = dict(rope_parameters) if per_layer_type else {FULL: rope_parameters}
        partial = float(next(iter(rope_by_kind.values()), {}).get("partial_rotary_factor") or 1.0)
        rotary_dim = int(head_dim * partial)
        max_positions = int(getattr(config, "max_position_embeddings", 4096))
        ropes, default_theta = [], 10000.0
        for kind, parameters in rope_by_kind.items():
            rope_type = parameters.get("rope_type") or parameters.get("type") or "default"
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"rope type {rope_type!r} is not supported (its frequencies change with the sequence length); "
                    f"verispec runs {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            default_theta = float(parameters.get("rope_theta") or getattr(config, "rope_theta", None) or default_theta)
            if rope_type != "default":
                ropes.append((kind, _scaled_rope(config, rope_type, kind if per_layer_type else None)))
            elif per_layer_type:
                theta = float(parameters["rope_theta"])
                ropes.append((kind, Rope(tuple(1.0 / (theta ** (i / rotary_dim)) for i in range(0, rotary_dim, 2)))))
            if rope_type == "longrope":
                # transformers switches to the long factors once a sequence passes the original length, which
                # changes the keys already cached: verispec keeps the short factors and stops there.
                original = parameters.get("original_max_position_embeddings")
                original = original or getattr(config, "original_max_position_embeddings", None) or max_positions
                max_positions = min(max_positions, int(original))
        layer_types = tuple(getattr(config, "layer_types", None) or ())
        sliding_window = getattr(config, "sliding_window", None)
        if layer_types and SLIDING not in layer_types:
            sliding_window = None  # (Qwen2/3 keep a sliding_window value with use_sliding_window false)
        gemma = model_type in GEMMA_TYPES
        no_rope = getattr(config, "no_rope_layers", None) or ()
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not supported; verispec runs {', '.join(ACTIVATIONS)}")
        scalar = getattr(config, "query_pre_attn_scalar", None)
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rope_theta=default_theta,
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=max_positions,
            model_type=model_type,
            hidden_act=activation,
            norm_plus_one=gemma,
            sandwich_norms=model_type in ("gemma2", "gemma3_text"),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            embed_scale=math.sqrt(config.hidden_size) if gemma else None,
            attention_scale=float(scalar) ** -0.5 if scalar and float(scalar) != head_dim else None,
            attn_softcap=getattr(config, "attn_logit_softcapping", None),
            final_softcap=getattr(config, "final_logit_softcapping", None),
            sliding_window=int(sliding_window) if sliding_window else None,
            layer_types=layer_types,
            no_rope_layers=tuple(i for i, rotates in enumerate(no_rope) if not rotates),
            rotary_dim=rotary_dim if rotary_dim != head_dim else None,
            ropes=tuple(ropes),
            fused_projections=model_type == "phi3",
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        return cls.from_hf_dict(json.loads((Path(model_dir) / "config.json").read_text()))


def _transformers_config(hf: dict):
    """transformers' config object for a config.json dict: it normalises legacy rope fields and fills defaults."""
    import transformers

    transformers.utils.logging.set_verbosity_error()  # (it warns of token ids outside tiny test vocabularies)
    fields = {key: value for key, value in hf.items() if key != "model_type"}
    return transformers.AutoConfig.for_model(hf["model_type"], **fields)


def _scaled_rope(config, rope_type: str, layer_type: str | None) -> Rope:
    """A scaled rotary embedding's frequencies, from transformers' own functions (the same numbers it uses)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    keyword = {"layer_type": layer_type} if layer_type else {}
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **keyword)
    return Rope(tuple(float(f) for f in inv_freq.double()), float(attention_scaling))
