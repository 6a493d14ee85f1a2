"""A decoder-only transformer (Llama / Qwen2 / Mistral) written around explicit positions.

Every forward takes the new tokens of each sequence, their positions, and an optional mask over
the new tokens (for token trees); it attends to the committed prefix in the KV cache plus the new
tokens. Plain decoding (T = 1), chain verification (T = k + 1), ragged batches and trees all go
through this one function, so speed comparisons between them are fair.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verispec.models.config import ModelConfig
from verispec.models.kv_cache import KVCache


INT4_GROUP_SIZE = 32  # inputs sharing one int4 scale and zero
QUANTIZED_MAX_ROWS = 4  # above this many tokens (prefill), the dense matmul beats the int kernels


class Linear:
    """y = x W^T + b, with W in the compute dtype, optionally also as int8 or int4 for few-row inputs.

    Weight-only quantized kernels read fewer bytes per token, which is what decoding a token at a
    time is bound by; for prefill (many rows) the dense matmul is faster, so both are kept.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # (out, in)
        self.bias = bias  # (out,) or None
        self.scales: torch.Tensor | None = None  # (out,) int8 scales, or (in/G, out, 2) int4 scales and zeros
        self.group_size = 0  # > 0 when weight is packed int4 with groups of this many inputs
        self.dense = weight  # (out, in) unquantized copy: faster than the int kernels for many rows

    def quantize_int8(self) -> None:
        """Weight-only int8 with one scale per output row: halves the bytes read per token."""
        w = self.weight.float()
        scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # (out,)
        self.weight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scales.to(torch.bfloat16)

    def quantize_int4(self, group_size: int = 32) -> None:
        """Weight-only asymmetric int4, one scale and zero per group of `group_size` inputs."""
        w = self.weight.float()
        out_features, in_features = w.shape
        groups = w.view(out_features, in_features // group_size, group_size)  # (out, in/G, G)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-8)
        q = torch.round((groups - low) / scale).clamp(0, 15).view(out_features, in_features).to(torch.int32)
        zero = low + 8 * scale  # the kernel computes (q - 8) * scale + zero
        self.scales = torch.cat([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
        self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)
        self.group_size = group_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, in)
        if self.scales is None or flat.shape[0] > QUANTIZED_MAX_ROWS:
            return F.linear(x, self.dense, self.bias)
        if self.group_size:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight, self.group_size, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales.to(x.dtype))
        y = y.reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Layer:
    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, config: ModelConfig) -> None:
        def w(name: str) -> torch.Tensor:
            return weights[prefix + name]

        attn = "self_attn."
        qkv_bias = None
        if config.qkv_bias:
            qkv_bias = torch.cat([w(attn + f"{p}_proj.bias") for p in "qkv"])
        # q, k and v share one matmul; so do the gate and up projections of the MLP.
        self.qkv = Linear(torch.cat([w(attn + f"{p}_proj.weight") for p in "qkv"]), qkv_bias)
        self.out = Linear(w(attn + "o_proj.weight"))
        self.gate_up = Linear(torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]))
        self.down = Linear(w("mlp.down_proj.weight"))
        self.attn_norm = w("input_layernorm.weight")
        self.mlp_norm = w("post_attention_layernorm.weight")


class Transformer:
    """Weights plus a pure forward function; owns no per-request state (that lives in KVCache)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.config = config
        self.dtype = dtype
        weights = {name: t.to(dtype) for name, t in weights.items()}
        self.embed = weights["model.embed_tokens.weight"]  # (V, C)
        self.layers = [Layer(weights, f"model.layers.{i}.", config) for i in range(config.num_layers)]
        self.final_norm = weights["model.norm.weight"]
        head = self.embed if config.tie_word_embeddings else weights.get("lm_head.weight", self.embed)
        self.lm_head = Linear(head)  # (V, C)
        self.output_token_ids: torch.Tensor | None = None  # (V',) when the head covers a subset
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).double() / config.head_dim))
        self._inv_freq = inv_freq  # (D/2,)
        self._rope_cache = torch.empty(0)
        self._rope_len = 0

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, batch_size, c.num_kv_heads, capacity, c.head_dim, self.dtype)

    def restrict_output_vocab(self, token_ids: torch.Tensor) -> None:
        """Project only onto `token_ids`: logits come back over that subset, in that order.

        A drafter may do this to save the cost of the full vocabulary projection; its proposals
        stay verifiable because q is reported over the full vocabulary (zero outside the subset).
        """
        self.output_token_ids = token_ids.long()
        self.lm_head = Linear(self.lm_head.weight[token_ids].contiguous())

    def quantize(self, bits: int) -> None:
        """Weight-only int8 or int4 for every matmul: only for drafters, the target stays exact.

        A matmul whose shape the int4 kernel cannot tile stays in bfloat16.
        """
        if self.dtype != torch.bfloat16:
            raise ValueError("weight-only quantization runs with bfloat16 activations")
        if bits not in (4, 8):
            raise ValueError(f"quantization to {bits} bits is not supported (use 4 or 8)")
        for linear in self._linears():
            out_features, in_features = linear.weight.shape
            if bits == 8:
                linear.quantize_int8()
            elif out_features % 16 == 0 and in_features % INT4_GROUP_SIZE == 0:  # the int4 kernel's tiling
                linear.quantize_int4(INT4_GROUP_SIZE)

    def _linears(self) -> list[Linear]:
        per_layer = [m for layer in self.layers for m in (layer.qkv, layer.out, layer.gate_up, layer.down)]
        return per_layer + [self.lm_head]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        needed = int(positions.max()) + 1
        if needed > self._rope_len:
            length = max(needed, 2 * self._rope_len, 1024)
            freqs = torch.outer(torch.arange(length).double(), self._inv_freq)  # (L, D/2)
            angles = torch.cat([freqs, freqs], dim=-1)  # (L, D)
            self._rope_cache = torch.stack([angles.cos(), angles.sin()]).to(self.dtype)  # (2, L, D)
            self._rope_len = length
        cos_sin = self._rope_cache[:, positions]  # (2, B, T, D)
        return cos_sin[0][:, None], cos_sin[1][:, None]  # (B, 1, T, D) each

    def _attention_mask(self, cache: KVCache, num_new: int, tree_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Boolean (B, 1, T, S) mask, True = may attend; None when plain causal needs no mask."""
        lengths = cache.lengths  # (B,)
        uniform = bool((lengths == lengths[0]).all())
        if tree_mask is None and num_new == 1 and uniform:
            return None
        total = int(lengths.max()) + num_new
        slots = torch.arange(total)  # (S,)
        new_index = slots[None, :] - lengths[:, None]  # (B, S): index among the new tokens, < 0 = prefix
        query = torch.arange(num_new)  # (T,)
        if tree_mask is None:
            visible = new_index[:, None, :] <= query[None, :, None]  # (B, T, S)
        else:
            in_new = (new_index >= 0) & (new_index < num_new)  # (B, S)
            gathered = torch.gather(
                tree_mask, 2, new_index.clamp(0, num_new - 1)[:, None, :].expand(-1, num_new, -1)
            )  # (B, T, S)
            visible = (new_index[:, None, :] < 0) | (in_new[:, None, :] & gathered)
        return visible[:, None]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits for new tokens placed after each row's committed prefix.

        input_ids: (B, T). positions: (B, T), default lengths + arange(T). tree_mask: (B, T, T) bool,
        new token t may see new token u; default causal. Writes keys/values at slots
        lengths[b] .. lengths[b] + T - 1 but commits nothing. Returns (B, T, V'), or (B, 1, V') with
        last_only, in float32; V' = V unless the output vocabulary was restricted.
        """
        c = self.config
        batch, num_new = input_ids.shape
        if positions is None:
            positions = cache.lengths[:, None] + torch.arange(num_new)  # (B, T)
        cos, sin = self._rope(positions)  # (B, 1, T, D)
        mask = self._attention_mask(cache, num_new, tree_mask)  # (B, 1, T, S) or None
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

        x = self.embed[input_ids]  # (B, T, C)
        for index, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)
            q, k, v = layer.qkv(h).split([q_size, kv_size, kv_size], dim=-1)  # (B, T, H*D), (B, T, Hkv*D) x2
            q = q.view(batch, num_new, c.num_heads, c.head_dim).transpose(1, 2)  # (B, H, T, D)
            k = k.view(batch, num_new, c.num_kv_heads, c.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
            v = v.view(batch, num_new, c.num_kv_heads, c.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            keys, values = cache.write(index, k, v)  # (B, Hkv, S, D)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)  # (B, H, T, D)
            x = x + layer.out(attn.transpose(1, 2).reshape(batch, num_new, q_size))
            h = rms_norm(x, layer.mlp_norm, c.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)  # (B, T, I) each
            x = x + layer.down(F.silu(gate) * up)

        if last_only:
            x = x[:, -1:]
        x = rms_norm(x, self.final_norm, c.rms_norm_eps)
        return self.lm_head(x).float()  # (B, T, V')
