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
from verispec.models.linear import FORMATS, Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


INVARIANT_ATTENTION_MAX_ROWS = 64  # longer inputs (prompt prefill) take one masked attention call


def _visible_slots(cache: KVCache, num_new: int, mask: torch.Tensor | None) -> list[list[int | torch.Tensor]]:
    """[b][t]: n when new token t of row b sees cache slots 0 .. n-1 (chains), else their indices (trees)."""
    lengths = cache.lengths.tolist()
    if mask is None:
        return [[length + t + 1 for t in range(num_new)] for length in lengths]
    rows = []
    for b, visible in enumerate(mask[:, 0]):  # (T, S) each
        counts = visible.sum(-1).tolist()
        rows.append([
            n if bool(visible[t, :n].all()) else visible[t].nonzero()[:, 0] for t, n in enumerate(counts)
        ])
    return rows


def _attention_per_row(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row_keys: list[list[int | torch.Tensor]]
) -> torch.Tensor:
    """Attention one query at a time over exactly the keys it sees, in slot order.

    q: (B, H, T, D); keys, values: (B, Hkv, S, D). A token verified at position p gets the very call
    (one query, keys 0 .. p) that plain decoding makes for it, so its result is bit-identical; a
    batched or masked call would reorder the sums with the number of rows. Costs one call per row,
    small next to the matmuls for the few rows of a verify pass.
    """
    out = torch.empty_like(q)  # (B, H, T, D)
    for b, per_token in enumerate(row_keys):
        for t, seen in enumerate(per_token):
            if isinstance(seen, int):
                k, v = keys[b : b + 1, :, :seen], values[b : b + 1, :, :seen]  # (1, Hkv, n, D)
            else:
                k, v = keys[b : b + 1, :, seen], values[b : b + 1, :, seen]  # (1, Hkv, n, D)
            out[b : b + 1, :, t : t + 1] = F.scaled_dot_product_attention(
                q[b : b + 1, :, t : t + 1], k, v, enable_gqa=True
            )
    return out


class Layer:
    def __init__(self, take, prefix: str, config: ModelConfig) -> None:
        """take(name) hands over one weight tensor (and forgets it, so quantizing frees the dense copy)."""

        def w(name: str) -> torch.Tensor:
            return take(prefix + name)

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

    @property
    def linears(self) -> list[Linear]:
        return [self.qkv, self.out, self.gate_up, self.down]


class Transformer:
    """Weights plus a pure forward function; owns no per-request state (that lives in KVCache).

    weight_format: one of FORMATS for every matmul (see verispec.models.linear), applied layer by
    layer while loading so that the dense weights of one layer are freed before the next is built.
    `weights` (a dict of tensors, or loading.SafetensorsWeights: anything with pop, `in` and clear)
    is consumed. on_layer(i) is called after each layer (progress bars).
    """

    def __init__(
        self,
        config: ModelConfig,
        weights,
        dtype: torch.dtype,
        weight_format: str = "none",
        activations: str = "s8",
        on_layer=None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.weight_format = "none"
        self.activations = activations
        # Per-row attention makes w8a8 batch-invariant; a draft model, whose numbers only steer
        # acceptance, turns it off for one batched attention call.
        self.invariant_attention = True
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(dtype)

        self.embed = take("model.embed_tokens.weight")  # (V, C)
        self._check_format(weight_format)
        self.layers = []
        for i in range(config.num_layers):
            layer = Layer(take, f"model.layers.{i}.", config)
            for linear in layer.linears:
                linear.quantize(weight_format, activations)
            self.layers.append(layer)
            if on_layer is not None:
                on_layer(i)
        self.final_norm = take("model.norm.weight")
        self.lm_head = Linear(self.embed if tied else take("lm_head.weight"))  # (V, C)
        self.lm_head.quantize(weight_format, activations)
        self.weight_format = weight_format
        weights.clear()  # anything left (an untied lm_head we did not use) is not needed
        self.output_token_ids: torch.Tensor | None = None  # (V',) when the head covers a subset
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).double() / config.head_dim))
        self._inv_freq = inv_freq  # (D/2,)
        self._rope_cache = torch.empty(0)
        self._rope_len = 0

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def batch_invariant(self) -> bool:
        """Each row of a forward gets the same logits as that row alone would (w8a8: see forward)."""
        return self.weight_format == "w8a8" and self.invariant_attention

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, batch_size, c.num_kv_heads, capacity, c.head_dim, self.dtype)

    def restrict_output_vocab(self, token_ids: torch.Tensor) -> None:
        """Project only onto `token_ids`: logits come back over that subset, in that order.

        A drafter may do this to save the cost of the full vocabulary projection; its proposals
        stay verifiable because q is reported over the full vocabulary (zero outside the subset).
        Call it before quantizing.
        """
        if self.weight_format != "none":
            raise ValueError("restrict the output vocabulary before quantizing the model")
        self.output_token_ids = token_ids.long()
        self.lm_head = Linear(self.lm_head.weight[token_ids].contiguous())

    def quantize(self, weight_format: str, activations: str = "s8") -> None:
        """Put every matmul of a dense model in `weight_format` (see FORMATS); drafters use this."""
        self._check_format(weight_format)
        if self.weight_format != "none":
            raise ValueError(f"the model is already in {self.weight_format}; load it again to change format")
        for linear in self._linears():
            linear.quantize(weight_format, activations)
        self.weight_format = weight_format
        self.activations = activations

    def _check_format(self, weight_format: str) -> None:
        if weight_format not in FORMATS:
            raise ValueError(f"weight format {weight_format!r} is not one of {', '.join(FORMATS)}")
        if weight_format in ("int8", "int4") and self.dtype != torch.bfloat16:
            raise ValueError(f"{weight_format} weight-only quantization runs with bfloat16 activations")

    def _linears(self) -> list[Linear]:
        return [m for layer in self.layers for m in layer.linears] + [self.lm_head]

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
        row_keys = None  # batch-invariant attention: for each (b, t), the cache slots it sees
        if self.batch_invariant and num_new <= INVARIANT_ATTENTION_MAX_ROWS:
            row_keys = _visible_slots(cache, num_new, mask)
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
            if row_keys is not None:
                attn = _attention_per_row(q, keys, values, row_keys)  # (B, H, T, D)
            else:
                attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = x + layer.out(attn.transpose(1, 2).reshape(batch, num_new, q_size))
            h = rms_norm(x, layer.mlp_norm, c.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)  # (B, T, I) each
            x = x + layer.down(F.silu(gate) * up)

        if last_only:
            x = x[:, -1:]
        x = rms_norm(x, self.final_norm, c.rms_norm_eps)
        return self.lm_head(x).float()  # (B, T, V')
