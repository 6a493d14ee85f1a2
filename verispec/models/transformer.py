"""A decoder-only transformer (the architectures of verispec.models.config) written around explicit positions.

Every forward takes the new tokens of each sequence, their positions, and an optional mask over
the new tokens (for token trees); it attends to the committed prefix in the KV cache plus the new
tokens. Plain decoding (T = 1), chain verification (T = k + 1), ragged batches and trees all go
through this one function, so speed comparisons between them are fair.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

from verispec.models import attention
from verispec.models.config import ModelConfig
from verispec.models.kv_cache import KVCache, WritePlan
from verispec.models.linear import BATCH_INVARIANT_FORMATS, FORMATS, Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype), x32 = x in float32.

    The weight is applied after the rounding, as Qwen2 and Llama do. Where verispec's kernels run,
    one call does it all, each row alone in a fixed order (kernels/norm.cpp: one pass where torch's
    formula takes six calls); else torch's rms_norm without a weight,
    which computes that normalisation in one call. tests/test_transformer.py checks both against
    the formula.
    x: (..., C); weight: (C,).
    """
    if norm_kernel_runs(x):
        return torch.ops.verispec.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    return weight * torch.rms_norm(x, (x.shape[-1],), None, eps)


def norm_kernel_runs(x: torch.Tensor) -> bool:
    """Whether kernels/norm.cpp takes x (..., C) here; asked of every norm, so a process norms one way."""
    return x.dtype in (torch.float32, torch.bfloat16) and x.shape[-1] % 16 == 0 and attention.kernels_available()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, bit for bit, with signed_sin = cat(-sin[:D/2], sin[D/2:]).

    rotate_half(x) * sin = swap_halves(x) * signed_sin element by element, because (-a) * b and
    a * (-b) round to the same number; swapping halves is one roll instead of slices, neg and cat.
    x: (..., D); cos, signed_sin broadcast to it.
    """
    rotated = x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin)  # (..., D) rotate_half(x) * sin
    return (x * cos).add_(rotated)  # (..., D)


# A prompt goes in by forwards that end at multiples of this many positions (see Transformer.prefill):
# each chunk is then the same computation however the prompt arrived, whole, in pieces between decode
# steps, or after a cached prefix, so its keys, values and logits are the same bits every way.
PREFILL_CHUNK = attention.INVARIANT_ATTENTION_MAX_ROWS


# The MLP's gate activations (config.ACTIVATIONS), as transformers computes them.
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


class RotaryTable:
    """cos and signed sin (see apply_rotary) of every position up to a length that grows on demand, (L, R) each.

    R = the rotary dims of a head (all of them, or Phi-4-mini's leading 3/4); the factor of scaled variants
    (longrope, yarn) is applied to both, as transformers does.
    """

    def __init__(self, config: ModelConfig, kind: str, dtype: torch.dtype) -> None:
        dim = config.rotary_dim or config.head_dim
        if config.ropes:
            rope = config.rope_of(kind)
            self.inv_freq, self.scaling = torch.tensor(rope.inv_freq, dtype=torch.float64), rope.attention_scaling
        else:
            self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).double() / dim))  # (R/2,)
            self.scaling = 1.0
        self.dtype = dtype
        self.cos = torch.empty(0)  # (L, R) in the compute dtype
        self.signed_sin = torch.empty(0)  # (L, R) sin, first half negated
        self.length = 0

    def grow(self, needed: int) -> None:
        """Make the tables cover positions 0 .. needed - 1."""
        if needed <= self.length:
            return
        length = max(needed, 2 * self.length, 1024)
        freqs = torch.outer(torch.arange(length).double(), self.inv_freq)  # (L, R/2)
        angles = torch.cat([freqs, freqs], dim=-1)  # (L, R)
        cos, sin = angles.cos(), angles.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        sin = sin.to(self.dtype)  # (L, R)
        half = sin.shape[-1] // 2
        self.cos = cos.to(self.dtype)  # (L, R)
        self.signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)  # (L, R)
        self.length = length


def norm_weight(weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The weight rms_norm takes for a checkpoint's norm weight: Gemma's norms scale by (1 + w)."""
    return (weight.float() + 1).to(weight.dtype) if config.norm_plus_one else weight


class Layer:
    def __init__(self, take, prefix: str, config: ModelConfig, index: int) -> None:
        """take(name) hands over one weight tensor (and forgets it, so quantizing frees the dense copy)."""

        def w(name: str) -> torch.Tensor:
            return take(prefix + name)

        def norm(name: str) -> torch.Tensor:
            return norm_weight(w(name), config)

        attn = "self_attn."
        qkv_bias = None
        if config.qkv_bias:
            qkv_bias = torch.cat([w(attn + f"{p}_proj.bias") for p in "qkv"])
        # q, k and v share one matmul; so do the gate and up projections of the MLP.
        if config.fused_projections:
            self.qkv = Linear(w(attn + "qkv_proj.weight"), qkv_bias)
            self.gate_up = Linear(w("mlp.gate_up_proj.weight"))
        else:
            self.qkv = Linear(torch.cat([w(attn + f"{p}_proj.weight") for p in "qkv"]), qkv_bias)
            self.gate_up = Linear(torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]))
        self.out = Linear(w(attn + "o_proj.weight"))
        self.down = Linear(w("mlp.down_proj.weight"))
        self.attn_norm = norm("input_layernorm.weight")
        # Gemma 2/3 norm the attention output with post_attention_layernorm and the MLP input with pre_feedforward.
        self.post_attn_norm = norm("post_attention_layernorm.weight") if config.sandwich_norms else None
        mlp_norm = "pre_feedforward_layernorm" if config.sandwich_norms else "post_attention_layernorm"
        self.mlp_norm = norm(mlp_norm + ".weight")
        self.post_mlp_norm = norm("post_feedforward_layernorm.weight") if config.sandwich_norms else None
        self.q_norm = norm(attn + "q_norm.weight") if config.qk_norm else None  # (D,)
        self.k_norm = norm(attn + "k_norm.weight") if config.qk_norm else None  # (D,)
        self.window = config.window(index)  # positions a query sees, itself included; None = all
        self.rope_kind = config.rope_kind(index)  # which rotary tables; None = no rotary embedding

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
        self.tied_head = config.tie_word_embeddings or "lm_head.weight" not in weights  # the head is the embedding

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(dtype)

        self.embed = take("model.embed_tokens.weight")  # (V, C)
        self._check_format(weight_format)
        self.layers = []
        for i in range(config.num_layers):
            layer = Layer(take, f"model.layers.{i}.", config, i)
            for linear in layer.linears:
                linear.quantize(weight_format, activations)
            self.layers.append(layer)
            if on_layer is not None:
                on_layer(i)
        self.final_norm = norm_weight(take("model.norm.weight"), config)
        self.lm_head = Linear(self.embed if self.tied_head else take("lm_head.weight"))  # (V, C)
        self.lm_head.quantize(weight_format, activations)
        self.weight_format = weight_format
        weights.clear()  # anything left (an untied lm_head we did not use) is not needed
        self.output_token_ids: torch.Tensor | None = None  # (V',) when the head covers a subset
        # One rotary table per kind of layer (Gemma 3: sliding and full layers rotate at different frequencies).
        kinds = {layer.rope_kind for layer in self.layers} - {None}
        self._rotary = {kind: RotaryTable(config, kind, dtype) for kind in sorted(kinds)}
        self._windows = {layer.window for layer in self.layers} - {None}  # the sliding layers' windows
        # The hidden states `hidden_out` hands on: () the last layer's; else those after each of these many layers,
        # side by side (..., F C) (a draft head that fuses low, middle and high layers reads them).
        self.feature_layers: tuple[int, ...] = ()

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def batch_invariant(self) -> bool:
        """Each row of a forward gets the same logits as that row alone would (w8a8: see forward)."""
        return self.weight_format in BATCH_INVARIANT_FORMATS and self.invariant_attention

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, batch_size, c.num_kv_heads, capacity, c.head_dim, self.dtype)

    def restrict_output_vocab(self, token_ids: torch.Tensor, dense_rows: torch.Tensor | None = None) -> None:
        """Project only onto `token_ids`: logits come back over that subset, in that order.

        A drafter may do this to save the cost of the full vocabulary projection; its proposals
        stay verifiable because q is reported over the full vocabulary (zero outside the subset).
        A quantized model needs the dense head's rows for those ids (dense_rows, (N, C)): the new head is
        quantized in the model's format.
        """
        if self.weight_format != "none" and dense_rows is None:
            raise ValueError("a quantized model's head is restricted from its dense rows: pass dense_rows")
        rows = self.lm_head.weight[token_ids] if dense_rows is None else dense_rows
        self.output_token_ids = token_ids.long()
        self.lm_head = Linear(rows.to(self.dtype).contiguous())
        self.lm_head.quantize(self.weight_format, self.activations)

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

    def _rope(self, plan: WritePlan, positions: torch.Tensor | None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos and signed sin (see apply_rotary) for each new token, (B or 1, T, 1, R) each, per rotary kind.

        positions: (B, T), or None for the default lengths + arange(T): then rows of one length
        take a slice of the tables instead of a gather.
        """
        tables = {}
        for kind, table in self._rotary.items():
            if positions is None and plan.uniform:
                table.grow(plan.start + plan.num_new)
                cos = table.cos.narrow(0, plan.start, plan.num_new)  # (T, R)
                sin = table.signed_sin.narrow(0, plan.start, plan.num_new)  # (T, R)
                tables[kind] = cos[None, :, None], sin[None, :, None]  # (1, T, 1, R) each
                continue
            where = plan.slots if positions is None else positions  # (B, T): default lengths + arange(T)
            table.grow(plan.end if positions is None else int(positions.max()) + 1)
            tables[kind] = table.cos[where][:, :, None], table.signed_sin[where][:, :, None]  # (B, T, 1, R)
        return tables

    def _attention_mask(
        self, cache: KVCache, plan: WritePlan, tree_mask: torch.Tensor | None, window: int | None = None
    ) -> torch.Tensor | None:
        """Boolean (B, 1, T, S) mask, True = may attend; None when plain causal needs no mask.

        window: a sliding layer's; a chain's query then sees the last `window` positions, itself included.
        """
        num_new = plan.num_new
        if tree_mask is None and num_new == 1 and plan.uniform and window is None:
            return None
        lengths = cache.lengths  # (B,)
        slots = torch.arange(plan.end)  # (S,)
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
        if window is not None:
            visible = visible & (new_index[:, None, :] > query[None, :, None] - window)
        return visible[:, None]

    def prefill(
        self, token_ids: list[int], cache: KVCache, max_tokens: int | None = None,
        hidden_out: list[torch.Tensor] | None = None,
    ) -> int:
        """Feed token_ids after the committed prefix of a one-row cache and commit them; returns how many.

        No forward crosses a multiple of PREFILL_CHUNK positions. A prefill split at such multiples
        (after a cached prefix's blocks, or by max_tokens) runs the very forwards of the
        whole-prompt prefill, so it gives the same keys, values and logits, bit for bit, in any
        weight format; a batch-invariant model gives them for a split anywhere. With max_tokens,
        feeds at most that many (the caller feeds the rest later, from where this stopped). hidden_out: gets
        the last layer's hidden states (T, C) of the tokens fed, one tensor per forward (see `forward`).
        """
        if cache.batch_size != 1:
            raise ValueError(f"prefill feeds one row, got a cache of {cache.batch_size}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        start = int(cache.lengths[0])
        end = start + len(token_ids) if max_tokens is None else start + min(len(token_ids), max_tokens)
        position = start
        while position < end:
            stop = min((position // PREFILL_CHUNK + 1) * PREFILL_CHUNK, end)
            hidden = [] if hidden_out is not None else None
            chunk = torch.tensor([token_ids[position - start : stop - start]])
            self.forward(chunk, cache, last_only=True, hidden_out=hidden)
            if hidden_out is not None:
                hidden_out.append(hidden[0][0])
            cache.commit(stop - position)
            position = stop
        return position - start

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        last_only: bool = False,
        hidden_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits for new tokens placed after each row's committed prefix.

        input_ids: (B, T). positions: (B, T), default lengths + arange(T). tree_mask: (B, T, T) bool,
        new token t may see new token u; default causal. Writes keys/values at slots
        lengths[b] .. lengths[b] + T - 1 but commits nothing. Returns (B, T, V'), or (B, 1, V') with
        last_only, in float32; V' = V unless the output vocabulary was restricted. hidden_out: gets the last
        layer's hidden states before the final norm, (B, T, C) in the compute dtype (what a draft head reads), or
        with feature_layers those layers', (B, T, F C).
        """
        c = self.config
        batch, num_new = input_ids.shape
        plan = cache.plan_write(num_new)  # where the new keys go, shared by every layer
        rotary = self._rope(plan, positions)  # kind -> cos, sin, (B or 1, T, 1, R) each
        # One query at a time: what batch invariance needs, and where the kernel runs, the fastest way for
        # any model to attend over a few new tokens (a tree of a model that need not be invariant takes one masked call).
        per_query = self.batch_invariant or (
            tree_mask is None and attention.attention_kernel_runs(c.head_dim, self.dtype)
        )
        per_query = per_query and num_new <= attention.INVARIANT_ATTENTION_MAX_ROWS
        windows = self._windows
        if windows and tree_mask is not None:
            raise ValueError("token trees do not run on models with sliding-window layers")
        masks = {None: None}  # window -> (B, 1, T, S): batched attention, and the visible slots of a tree
        if tree_mask is not None or not per_query:
            masks = {window: self._attention_mask(cache, plan, tree_mask, window) for window in windows | {None}}
        row_keys = None  # window -> for each (b, t), the slots it sees
        if per_query:
            full = attention.visible_slots(plan, masks[None])
            row_keys = {window: attention.windowed(full, window) for window in windows} | {None: full}
        heads, kv_heads = c.num_heads, c.num_kv_heads
        q_size, kv_size = heads * c.head_dim, kv_heads * c.head_dim
        qk_size = q_size + kv_size

        def attend(index: int, qkv: torch.Tensor) -> torch.Tensor:  # (B, T, (H + 2 Hkv) D) -> (B, T, H D)
            layer = self.layers[index]
            qk = qkv.narrow(-1, 0, qk_size).view(batch, num_new, heads + kv_heads, c.head_dim)  # (B, T, H + Hkv, D)
            qk = self._position_qk(layer, qk, rotary)  # q and k take their rotary embedding in one go
            q = self._scale_queries(qk.narrow(2, 0, heads).transpose(1, 2))  # (B, H, T, D)
            k = qk.narrow(2, heads, kv_heads).transpose(1, 2)  # (B, Hkv, T, D)
            v = qkv.narrow(-1, qk_size, kv_size).view(batch, num_new, kv_heads, c.head_dim)  # (B, T, Hkv, D)
            v = v.transpose(1, 2)  # (B, Hkv, T, D)
            keys, values = cache.write(index, k, v, plan)  # (B, Hkv, S, D)
            if row_keys is not None:
                attn = attention.attention_per_row(q, keys, values, row_keys[layer.window], c.attn_softcap)
                attn = attn.to(self.dtype)
            else:  # in float32: see attention.ATTENTION_DTYPE
                q, keys, values = (t.to(attention.ATTENTION_DTYPE) for t in (q, keys, values))
                attn = attention.masked_attention(q, keys, values, masks[layer.window], c.attn_softcap)
                attn = attn.to(self.dtype)
            return attn.transpose(1, 2).reshape(batch, num_new, q_size)

        kept = [] if hidden_out is not None and self.feature_layers else None
        x = self._layers(self._embed(input_ids), attend, kept)  # (B, T, C)
        if hidden_out is not None:
            hidden_out.append(torch.cat(kept, -1) if kept else x)
        if last_only:
            x = x[:, -1:]
        return self._logits(x)  # (B, T, V')

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states (..., C) of token ids (...,); Gemma scales them by sqrt(C), rounded to the compute dtype."""
        x = self.embed[token_ids]
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=self.dtype)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits (..., V') of the last layer's hidden states (..., C); Gemma 2 soft-caps them."""
        logits = self.lm_head(rms_norm(x, self.final_norm, self.config.rms_norm_eps)).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap).mul_(cap)

    def _position_qk(self, layer: Layer, qk: torch.Tensor, rotary: dict) -> torch.Tensor:
        """q and k heads (..., H + Hkv, D), normed per head where the model does (Qwen3, Gemma 3) and rotated.

        rotary: kind -> (cos, signed sin) broadcasting to (..., 1, R); R < D rotates the leading R dims only.
        """
        c = self.config
        if layer.q_norm is not None:
            q, k = qk.narrow(-2, 0, c.num_heads), qk.narrow(-2, c.num_heads, c.num_kv_heads)
            qk = torch.cat([rms_norm(q, layer.q_norm, c.rms_norm_eps), rms_norm(k, layer.k_norm, c.rms_norm_eps)], -2)
        if layer.rope_kind is None:
            return qk
        cos, sin = rotary[layer.rope_kind]
        if c.rotary_dim is None:
            return apply_rotary(qk, cos, sin)
        return torch.cat([apply_rotary(qk[..., : c.rotary_dim], cos, sin), qk[..., c.rotary_dim :]], dim=-1)

    def _scale_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q (..., D) so that attention's head_dim ** -0.5 makes the model's own softmax scale (Gemma's)."""
        if self.config.attention_scale is None:
            return q
        return q * (self.config.attention_scale * self.config.head_dim**0.5)

    def _layers(self, x: torch.Tensor, attend, kept: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The decoder layers over hidden states x (..., C); attend(layer index, qkv (..., (H + 2 Hkv) D))
        stores the new keys and values and returns the attention output (..., H D). kept: gets the hidden states
        after each of feature_layers layers."""
        eps = self.config.rms_norm_eps
        activation = ACTIVATIONS[self.config.hidden_act]
        for index, layer in enumerate(self.layers):
            attended = layer.out(attend(index, layer.qkv(rms_norm(x, layer.attn_norm, eps))))  # (..., C)
            if layer.post_attn_norm is not None:
                attended = rms_norm(attended, layer.post_attn_norm, eps)
            x = x + attended
            gate, up = layer.gate_up(rms_norm(x, layer.mlp_norm, eps)).chunk(2, dim=-1)  # (..., I) each
            mixed = layer.down(activation(gate).mul_(up))  # (..., C)
            if layer.post_mlp_norm is not None:
                mixed = rms_norm(mixed, layer.post_mlp_norm, eps)
            x = x + mixed
            if kept is not None and index + 1 in self.feature_layers:
                kept.append(x)
        return x

    @torch.inference_mode()
    def forward_packed(
        self, row_tokens: list[list[int]], cache: KVCache, with_logits: list[bool],
        hidden_out: list[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor | None]:
        """One forward over rows that each bring their own number of new tokens (none, a verify pass, a prompt chunk).

        row_tokens[b]: the new tokens of cache row b, placed after its committed prefix; with_logits[b]:
        whether row b wants logits (a prompt chunk needs none, and skips the output projection). The
        matmuls see only the real tokens, packed into one (N, C) input, no padding; attention is one
        query at a time over exactly the slots each sees, as in `forward` for passes of up to
        attention.INVARIANT_ATTENTION_MAX_ROWS tokens. So in a batch-invariant model every token gets the
        bits it gets in `forward` or `prefill` (tests/test_transformer.py). Writes keys and values, commits
        nothing. Returns, per row, (T_b, V') float32 logits, or None where not asked for or T_b = 0.
        hidden_out: gets, per row, the last layer's hidden states (T_b, C) before the final norm (None where
        T_b = 0), for every row: a prompt chunk's too.
        """
        c = self.config
        if len(row_tokens) != cache.batch_size or len(with_logits) != cache.batch_size:
            raise ValueError(f"row_tokens and with_logits need one entry per cache row ({cache.batch_size})")
        lengths = cache.lengths.tolist()
        counts = [len(tokens) for tokens in row_tokens]
        end = max(length + count for length, count in zip(lengths, counts))
        if end > cache.capacity:
            raise RuntimeError(f"KV cache overflow: {end} tokens > capacity {cache.capacity}")
        total = sum(counts)
        if total == 0:
            if hidden_out is not None:
                hidden_out.extend([None] * len(row_tokens))
            return [None] * len(row_tokens)
        starts = list(itertools.accumulate(counts, initial=0))  # row b's tokens are [starts[b], starts[b + 1])
        rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))  # (N,)
        slots = torch.cat([torch.arange(n, dtype=torch.long) + length for length, n in zip(lengths, counts)])  # (N,)
        rotary = {}  # kind -> cos, sin of each token's slot, (N, 1, R) each
        for kind, table in self._rotary.items():
            table.grow(end)
            rotary[kind] = table.cos[slots][:, None], table.signed_sin[slots][:, None]
        windows = self._windows
        groups = []  # (first row, last row, width, where each of their tokens sits in (rows * width) padded queries)
        for first, last in attention.attention_groups(counts):
            width = max(counts[first:last])
            padded_index = torch.cat([torch.arange(counts[b]) + (b - first) * width for b in range(first, last)])
            row_keys = [[lengths[b] + t + 1 for t in range(counts[b])] + [1] * (width - counts[b]) for b in range(first, last)]
            row_keys = {window: attention.windowed(row_keys, window) for window in windows} | {None: row_keys}
            groups.append((first, last, width, padded_index, row_keys))
        heads, kv_heads = c.num_heads, c.num_kv_heads
        q_size, kv_size = heads * c.head_dim, kv_heads * c.head_dim
        qk_size = q_size + kv_size

        def attend(index: int, qkv: torch.Tensor) -> torch.Tensor:  # (N, (H + 2 Hkv) D) -> (N, H D)
            layer = self.layers[index]
            qk = self._position_qk(layer, qkv.narrow(-1, 0, qk_size).view(total, heads + kv_heads, c.head_dim), rotary)
            keys, values = cache.keys[index], cache.values[index]  # (B, Hkv, capacity, D)
            keys[rows, :, slots] = qk.narrow(1, heads, kv_heads)  # (N, Hkv, D) into each token's slot
            values[rows, :, slots] = qkv.narrow(-1, qk_size, kv_size).view(total, kv_heads, c.head_dim)
            q = self._scale_queries(qk.narrow(1, 0, heads))  # (N, H, D)
            out = torch.empty(total, heads, c.head_dim, dtype=self.dtype)  # (N, H, D)
            for first, last, width, padded_index, row_keys in groups:  # rows [first, last), padded to the longest
                tokens = slice(starts[first], starts[last])
                rows_q = q[tokens]  # (n_g, H, D)
                if padded_index.shape[0] != (last - first) * width:  # ragged: a padding query sees slot 0 only
                    padded = q.new_zeros((last - first) * width, heads, c.head_dim)
                    padded[padded_index] = rows_q
                    rows_q = padded
                span = max(lengths[b] + counts[b] for b in range(first, last))
                attn = attention.attention_per_row(
                    rows_q.view(last - first, width, heads, c.head_dim).transpose(1, 2),
                    keys[first:last, :, :span], values[first:last, :, :span], row_keys[layer.window], c.attn_softcap,
                ).to(self.dtype)  # (b, H, T, D)
                out[tokens] = attn.transpose(1, 2).reshape(-1, heads, c.head_dim)[padded_index]
            return out.view(total, q_size)

        kept = [] if hidden_out is not None and self.feature_layers else None
        x = self._layers(self._embed(torch.tensor([t for tokens in row_tokens for t in tokens])), attend, kept)
        if hidden_out is not None:  # (N, C), or (N, F C) with feature_layers, by row
            features = torch.cat(kept, -1) if kept else x
            hidden_out.extend(row_x if len(row_x) else None for row_x in features.split(counts))
        wanted = [b for b in range(len(counts)) if with_logits[b] and counts[b]]
        results: list[torch.Tensor | None] = [None] * len(counts)
        if wanted:
            index = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in wanted])
            logits = self._logits(x[index])  # (N', V')
            for b, row_logits in zip(wanted, logits.split([counts[b] for b in wanted])):
                results[b] = row_logits
        return results
