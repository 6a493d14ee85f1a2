"""A draft head over the target's own hidden states (EAGLE-1's shape): one decoder layer and the target's head.

At position t the head reads the target's last hidden state f_t (normalized) and the embedding of the
token that follows, x_{t+1}; one decoder layer, causal over the positions before it, predicts the
normalized f_{t+1}, and the target's own final norm and output head, restricted to the `vocab` ids the
head was trained on, turn it into a draft for x_{t+2}. Drafting on, the head feeds its own prediction
and its draft back in. It reads no model of its own, so a draft position costs one small layer and a
head over a fraction of the vocabulary: a small fraction of the target's forward
(benchmarks/results/xeon/draft-head). q is zero outside `vocab`, so verification stays exact whatever the weights.

The layer's math is defined once, in `HeadMath`: `DraftHead` is it as a trainable module over torch Linears in
float32 (benchmarks/draft_head/study.py trains it), `HeadLayer` is it for drafting, over the target's `Linear`s in
its weight format, with a key-value cache of its own; a head is saved as safetensors (`save_head`) and loaded
against its target (`load_head`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from verispec.models.attention import attention_kernel_runs
from verispec.models.linear import Linear, quantize_rows
from verispec.models.machine import cache_root
from verispec.models.transformer import Transformer

if TYPE_CHECKING:
    from verispec.models.loading import LoadedModel

HEAD_FORMAT = "verispec-draft-head-1"
HEAD_DRAFT = "head"  # `--draft head`: the target's head (built by `make head`, else shipped), in head_path(target)
SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "data" / "heads"  # the heads verispec ships
SHIPPED_MANIFEST = "heads.json"  # target name -> {"file", "sha256", "trained": how}: what load_head checks
HEAD_WEIGHTS = ("float32", "int8")  # how a head file stores its matrices (int8: per row, with float32 scales)
TRAINED = ("fc", "attn_norm", "qkv.weight", "qkv.bias", "out", "mlp_norm", "gate_up", "down")


def rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x (..., C) scaled to unit root mean square, computed in float32 and returned in x's dtype."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    half = head_dim // 2
    return theta ** (-torch.arange(half, dtype=torch.float32) / half)  # (D/2,)


def rotary(positions: torch.Tensor, head_dim: int, theta: float,
           inverse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (..., D) at positions (...): rotate-half layout, as Qwen's layers."""
    inverse = inverse_frequencies(head_dim, theta) if inverse is None else inverse
    angles = positions.float()[..., None] * inverse  # (..., D/2)
    return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class HeadMath:
    """The head's layer, its one definition: the fusion of the target's features with the next token's embedding
    (fc), the attention's projections, norms and rotary, the residuals and the MLP, and the scores over the head's
    vocabulary. Training (DraftHead) and drafting (HeadLayer) run these over their own weights; they differ only in
    which keys and values a query attends to (the whole sequence causally, or a cache) and in the weights' format.

    A subclass provides embed (V, C) and final_norm (C,) (the target's), attn_norm and mlp_norm (C,); fc, qkv, out,
    gate_up, down and lm_head (the output head's rows over `vocab`), each callable as x -> x W^T (+ b); heads,
    head_dim, rope_theta, inverse (the rotary's inverse frequencies, (D/2,)); and dtype, what its matmuls read.
    Casts to dtype or float32 are no-ops (the same tensor) in a float32 module, so training's graph has none.
    A head that fuses several of the target's layers (EAGLE-3) has feature_layers, the layer counts it reads the
    hidden states after, and fuse, (C, F C); else the last layer's hidden state is its feature.
    """

    feature_layers: tuple[int, ...] = ()  # (a subclass sets fuse where it has them)

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states (..., C), or (..., F C) of its feature_layers -> the head's normalized
        features (..., C) in float32: rms(hidden), or rms(fuse([rms(h) for each layer's h]))."""
        if not self.feature_layers:
            return rms(hidden.float())
        layers = [rms(part.float()) for part in hidden.chunk(len(self.feature_layers), -1)]
        return rms(self.fuse(torch.cat(layers, -1).to(self.dtype)).float())

    def layer_input(self, features: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """(..., C) normalized features (float32) and (...,) next token ids -> the layer's input (..., C): fc over the
        features beside the normalized embedding of each next token."""
        return self.fc(torch.cat([features, rms(self.embed[next_ids].float())], -1).to(self.dtype))

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x (B, T, C) -> q, k (B, H, T, D) rotated at positions (T,) shared by the rows or (B, T) each row's, in
        float32, and v (B, H, T, D) in x's dtype."""
        b, t, _ = x.shape
        qkv = self.qkv(rms(x) * self.attn_norm).view(b, t, 3, self.heads, self.head_dim)
        q, k, v = (part.transpose(1, 2) for part in qkv.unbind(2))  # (B, H, T, D) each
        cos, sin = rotary(positions, self.head_dim, self.rope_theta, self.inverse)  # (T, D) or (B, T, D)
        if positions.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D)
        return rotate(q.float(), cos, sin), rotate(k.float(), cos, sin), v

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) and the attention's output (B, H, T, D) -> the normalized predicted feature (B, T, C) in float32:
        the attention through `out` and the MLP, each added to the residual, then normalized."""
        b, t, _ = x.shape
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, -1).to(self.dtype))  # (B, T, H D) -> (B, T, C)
        gate, up = self.gate_up(rms(x) * self.mlp_norm).chunk(2, -1)
        return rms((x + self.down(F.silu(gate) * up)).float())

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """(..., C) normalized predicted features -> float32 scores (..., V') over `vocab`."""
        return self.lm_head((predicted * self.final_norm.float()).to(self.dtype)).float()


class DraftHead(HeadMath, torch.nn.Module):
    """fc([rms(f_t), rms(emb(x_{t+1}))]) -> one decoder layer (causal over the sequence) -> predicted rms(f_{t+1}):
    the head's layer (HeadMath) as a trainable module.

    The target's embedding, final norm and output head (restricted to `vocab` ids) are frozen buffers."""

    def __init__(self, embed: torch.Tensor, final_norm: torch.Tensor, head: torch.Tensor, vocab: torch.Tensor,
                 heads: int, intermediate: int, rope_theta: float, feature_layers: tuple[int, ...] = ()) -> None:
        super().__init__()
        width = embed.shape[1]
        self.register_buffer("embed", embed, persistent=False)  # (V, C)
        self.register_buffer("final_norm", final_norm, persistent=False)  # (C,)
        self.register_buffer("head", head[vocab], persistent=False)  # (V', C)
        self.register_buffer("vocab", vocab)  # (V',) target ids of the head's rows
        self.heads, self.head_dim = heads, width // heads
        self.register_buffer("inverse", inverse_frequencies(self.head_dim, rope_theta), persistent=False)  # (D/2,)
        self.fc = torch.nn.Linear(2 * width, width, bias=False)
        self.attn_norm = torch.nn.Parameter(torch.ones(width))
        self.qkv = torch.nn.Linear(width, 3 * width, bias=True)
        self.out = torch.nn.Linear(width, width, bias=False)
        self.mlp_norm = torch.nn.Parameter(torch.ones(width))
        self.gate_up = torch.nn.Linear(width, 2 * intermediate, bias=False)
        self.down = torch.nn.Linear(intermediate, width, bias=False)
        self.rope_theta = rope_theta
        with torch.no_grad():  # start near "the next feature is this one": fc passes rms(f_t) on
            self.fc.weight.zero_()
            self.fc.weight[:, :width].copy_(torch.eye(width))
            self.fc.weight[:, width:].normal_(0, 0.02)
            for linear in (self.qkv, self.out, self.gate_up, self.down):
                linear.weight.normal_(0, 0.02)
            self.out.weight.mul_(0.1)
            self.down.weight.mul_(0.1)
        self.feature_layers = tuple(feature_layers)
        if feature_layers:  # starts passing the last of them on
            self.fuse = torch.nn.Linear(len(feature_layers) * width, width, bias=False)
            with torch.no_grad():
                self.fuse.weight.normal_(0, 0.02)
                self.fuse.weight[:, -width:].copy_(torch.eye(width))

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.head.T  # (..., V')

    def forward(self, features: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: features (B, T, C) normalized f_0..f_{T-1}, next_ids (B, T) x_1..x_T -> predicted
        normalized f_1..f_T (B, T, C)."""
        x = self.layer_input(features, next_ids)
        q, k, v = self.project(x, torch.arange(x.shape[1]))
        return self.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def trained_tensors(self) -> dict[str, torch.Tensor]:
        """What a head file holds: the trained weights (float32) and the head's vocabulary."""
        return {
            "fc": self.fc.weight, "attn_norm": self.attn_norm, "qkv.weight": self.qkv.weight,
            "qkv.bias": self.qkv.bias, "out": self.out.weight, "mlp_norm": self.mlp_norm,
            "gate_up": self.gate_up.weight, "down": self.down.weight, "vocab": self.vocab,
        } | ({"fuse": self.fuse.weight} if self.feature_layers else {})


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A matrix (N, K) as int8 (N, K) and one float32 scale per row (N,), symmetric: weight ~ q * scale[:, None]."""
    quantized, scale = quantize_rows(weight.detach())  # (N, K) integers in float, (N, 1)
    return quantized.to(torch.int8), scale[:, 0]


def from_int8_rows(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8_rows' inverse, in float32 (N, K)."""
    return quantized.float() * scale[:, None]


def stored_tensors(head: DraftHead, weights: str = "float32") -> dict[str, torch.Tensor]:
    """What a head file holds: the trained tensors in float32, or with `weights` "int8" each matrix as int8 per row
    and its scales (`<name>.scale`; a quarter of the bytes), and the head's vocabulary."""
    if weights not in HEAD_WEIGHTS:
        raise ValueError(f"head weights {weights!r} is not one of {', '.join(HEAD_WEIGHTS)}")
    tensors = {"vocab": head.vocab.long()}
    for name, tensor in head.trained_tensors().items():
        if name == "vocab":
            continue
        if weights == "int8" and tensor.dim() == 2:
            tensors[name], tensors[f"{name}.scale"] = int8_rows(tensor)
        else:
            tensors[name] = tensor.detach().float()
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def loaded_tensors(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A head file's tensors with every int8 matrix (one with a `<name>.scale`) back in float32."""
    return {name: from_int8_rows(tensor, stored[f"{name}.scale"]) if f"{name}.scale" in stored else tensor
            for name, tensor in stored.items() if not name.endswith(".scale")}


def save_head(head: DraftHead, path: Path, target_name: str, about: dict | None = None,
              weights: str = "float32") -> None:
    """Write a head as safetensors (its matrices in `weights`: float32, or int8 per row), with what loading it
    needs (its target, shape) and `about` (its training)."""
    from safetensors.torch import save_file

    tensors = stored_tensors(head, weights)
    metadata = {
        "format": HEAD_FORMAT, "target": target_name, "heads": str(head.heads), "rope_theta": repr(head.rope_theta),
        "weights": weights, "about": json.dumps(about or {}),
        "feature_layers": ",".join(map(str, head.feature_layers)),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)


def built_head_path(target_name: str) -> Path:
    """Where `make head` puts the head it trains for a target (by the target's name)."""
    return cache_root() / "heads" / f"{Path(target_name).name}.safetensors"


def shipped_head(target_name: str) -> tuple[Path, str] | None:
    """(the file, its sha256) of the head verispec ships for a target (SHIPPED_HEADS' manifest), where it ships one."""
    try:
        entries = json.loads((SHIPPED_HEADS / SHIPPED_MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    entry = entries.get(Path(target_name).name)
    return None if entry is None else (SHIPPED_HEADS / entry["file"], entry["sha256"])


def head_path(target_name: str) -> Path:
    """The head `--draft head` drafts with: the one `make head` built on this machine (retrained, or for another
    target), else the one verispec ships for the target; where neither exists, where `make head` would put one."""
    built, shipped = built_head_path(target_name), shipped_head(target_name)
    return built if built.is_file() or shipped is None else shipped[0]


def ship_head(path: Path, target_name: str, trained: dict) -> None:
    """Make `path`, a head file in SHIPPED_HEADS, the head verispec ships for a target, with its sha256 and how it
    was `trained`: it replaces the one shipped for that target before (its old file is removed)."""
    manifest = SHIPPED_HEADS / SHIPPED_MANIFEST
    try:
        entries = json.loads(manifest.read_text())
    except (OSError, ValueError):
        entries = {}
    name = Path(target_name).name
    old = entries.get(name, {}).get("file")
    if old and old != path.name:
        (SHIPPED_HEADS / old).unlink(missing_ok=True)
    entries[name] = {"file": path.name, "sha256": _sha256(path), "trained": trained}
    manifest.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_shipped(path: Path, target_name: str) -> None:
    """Refuse a shipped head whose bytes are not the ones verispec shipped (a damaged or replaced file)."""
    shipped = shipped_head(target_name)
    if shipped is None or Path(path).resolve() != shipped[0].resolve():
        return
    if _sha256(path) != shipped[1]:
        raise ValueError(
            f"the draft head shipped for {Path(target_name).name} ({path}) does not match its sha256 in "
            f"{SHIPPED_HEADS / SHIPPED_MANIFEST}: the file is damaged or was replaced; restore it (git checkout "
            f"{path.name}, or reinstall verispec), build one with `make head`, or pass --draft with a head file"
        )


def is_head_spec(draft: str | None) -> bool:
    """Whether a `--draft` value names a draft head: "head" (the target's, see head_path) or a head file."""
    return draft is not None and (draft == HEAD_DRAFT or draft.endswith(".safetensors") and Path(draft).is_file())


class HeadLayer(HeadMath):
    """The head's layer (HeadMath) for drafting: its matmuls as the target's `Linear`s, in the target's weight format;
    the target's embedding and final norm shared, its output-head rows over `vocab` in that format too; its keys and
    values in a cache of its own (`step`)."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], heads: int, rope_theta: float, target: Transformer,
        head_rows: torch.Tensor, feature_layers: tuple[int, ...] = (),
    ) -> None:
        """head_rows: the target's dense output-head rows (V', C) of the head's vocabulary (tensors["vocab"]);
        feature_layers: where the head fuses several layers' hidden states (tensors["fuse"])."""
        dtype = target.dtype
        width = target.embed.shape[1]
        fc = tensors["fc"]
        if fc.shape != (width, 2 * width):
            raise ValueError(
                f"the draft head is {fc.shape[0]} wide, the target {width}: it was trained for another target"
            )
        self.embed, self.final_norm, self.dtype = target.embed, target.final_norm, dtype
        self.vocab = tensors["vocab"].long()  # (V',) target ids of the head's rows
        self.output_token_ids = self.vocab
        self.heads, self.head_dim, self.rope_theta, self.width = heads, width // heads, rope_theta, width
        self.inverse = inverse_frequencies(self.head_dim, rope_theta)  # (D/2,)
        self.attn_norm = tensors["attn_norm"].to(dtype)
        self.mlp_norm = tensors["mlp_norm"].to(dtype)

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
            layer = Linear(weight.to(dtype).contiguous(), None if bias is None else bias.to(dtype))
            layer.quantize(target.weight_format, target.activations)
            return layer

        self.fc, self.qkv = linear(fc), linear(tensors["qkv.weight"], tensors["qkv.bias"])
        self.out, self.gate_up, self.down = linear(tensors["out"]), linear(tensors["gate_up"]), linear(tensors["down"])
        self.lm_head = linear(head_rows)  # (V', C)
        self.feature_layers = tuple(feature_layers)
        if feature_layers:
            fuse = tensors.get("fuse")
            if fuse is None or fuse.shape != (width, len(feature_layers) * width):
                raise ValueError(f"the draft head reads layers {feature_layers} but has no fuse of their width")
            if max(feature_layers) > target.config.num_layers:
                raise ValueError(f"the draft head reads layer {max(feature_layers)}: the target has "
                                 f"{target.config.num_layers}; it was trained for another target")
            self.fuse = linear(fuse)
        self.feature_width = width * max(1, len(self.feature_layers))  # of the target's hidden states it reads

    def new_cache(self, batch_size: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values, (B, H, capacity, D) each."""
        shape = (batch_size, self.heads, capacity, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)

    @torch.inference_mode()
    def step(
        self, features: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
        keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, normalized: bool,
    ) -> torch.Tensor:
        """One layer over T new positions of each of B rows, after each row's `lengths` cached ones.

        features (B, T, C): the target's hidden states (normalized False) or the head's own predictions;
        next_ids (B, T); positions (B, T) absolute. Writes the new keys and values at slots lengths[b] ..
        lengths[b] + T - 1 of keys, values (B, H, S, D) and commits nothing. Returns the predicted normalized
        features (B, T, C) in float32.
        """
        batch, num_new = next_ids.shape
        f = features.float() if normalized else self.target_features(features)
        x = self.layer_input(f, next_ids)  # (B, T, C)
        q, k, v = self.project(x, positions)  # (B, H, T, D) each
        slots = lengths[:, None] + torch.arange(num_new)  # (B, T)
        rows = torch.arange(batch)[:, None].expand(-1, num_new)
        keys[rows, :, slots] = k.transpose(1, 2).to(keys.dtype)  # (B, T, H, D) into each token's slot
        values[rows, :, slots] = v.transpose(1, 2).to(values.dtype)
        return self.finish(x, attend_cached(q.to(keys.dtype), keys, values, slots))  # (B, T, C)


def attend_cached(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Each new position's attention over its row's cache up to its own slot: q (B, H, T, D) in the cache's dtype,
    keys and values (B, H, S, D), slots (B, T). Returns (B, H, T, D).

    verispec's attention kernel, where it runs, attends each query over just the slots it sees; with torch's masked
    bfloat16 attention instead, a head draft position cost 1.25-3.7x as much on an AMD Zen 4 (1 to 16 rows, 256 to
    1500 cached tokens: benchmarks/results/zen4/head-attention).
    """
    if attention_kernel_runs(q.shape[-1], q.dtype):
        return torch.ops.verispec.attend(q, keys, values, slots + 1)  # counts: slots 0 .. slot
    span = int(slots.max()) + 1
    visible = torch.arange(span)[None, None, :] <= slots[:, :, None]  # (B, T, S)
    return F.scaled_dot_product_attention(q, keys[:, :, :span], values[:, :, :span], attn_mask=visible[:, None])


def output_rows(target: "LoadedModel", token_ids: torch.Tensor) -> torch.Tensor:
    """The target's dense output-head rows (N, C) of token_ids: its embedding's where the head is tied, else read
    from its weights' files (a quantized head keeps no dense copy)."""
    from safetensors import safe_open

    model = target.model
    if model.tied_head:
        return model.embed[token_ids]
    if model.lm_head.dense is not None and model.lm_head.dense.shape[0] == model.vocab_size:
        return model.lm_head.dense[token_ids]
    for path in sorted(Path(target.directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            if "lm_head.weight" in handle.keys():
                return handle.get_tensor("lm_head.weight")[token_ids].to(model.dtype)
    raise ValueError(f"no lm_head.weight in {target.directory}: the draft head cannot use this target's output head")


def head_file(spec: str, target_name: str) -> Path:
    """The file a head spec names ("head": the one `make head` built for the target; or a head file's path), or a
    FileNotFoundError that says how to build it."""
    path = head_path(target_name) if spec == HEAD_DRAFT else Path(spec)
    if not path.is_file():
        raise FileNotFoundError(
            f"no draft head for {Path(target_name).name} at {path}: build it with `make head` "
            "(trains one on this machine) or pass --draft with a head file"
        )
    return path


def load_head(spec: str, target: "LoadedModel") -> HeadLayer:
    """The head `spec` names ("head": the target's, built by `make head` or shipped, see head_path; or a head file)
    over the loaded target; a shipped head is checked against its sha256 first."""
    from safetensors import safe_open

    path = head_file(spec, target.name)
    check_shipped(path, target.name)
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        if metadata.get("format") != HEAD_FORMAT:
            raise ValueError(f"{path} is not a verispec draft head (format {metadata.get('format')!r})")
        tensors = loaded_tensors({name: handle.get_tensor(name) for name in handle.keys()})
    missing = [name for name in (*TRAINED, "vocab") if name not in tensors]
    if missing:
        raise ValueError(f"draft head {path} lacks {', '.join(missing)}: build it again with `make head`")
    if metadata.get("target") and Path(metadata["target"]).name != Path(target.name).name:
        raise ValueError(f"draft head {path} was trained for {metadata['target']}, not {target.name}")
    rows = output_rows(target, tensors["vocab"].long())
    layers = tuple(int(layer) for layer in metadata.get("feature_layers", "").split(",") if layer)
    return HeadLayer(tensors, int(metadata["heads"]), float(metadata["rope_theta"]), target.model, rows, layers)


class HeadForwarding:
    """A head as forward_costs times a model (verispec.models.forward_cost.Forwarding), for `verispec doctor`: a
    forward feeds n new positions of each row (random target features, the given next tokens) through the layer
    and scores them, as a drafting step's feed and draft positions do."""

    def __init__(self, head: HeadLayer, vocab_size: int) -> None:
        self.head, self.vocab_size = head, vocab_size  # the target's: input ids are target ids

    def new_cache(self, batch_size: int, capacity: int) -> "_HeadCache":
        return _HeadCache(*self.head.new_cache(batch_size, capacity))

    def forward(self, input_ids: torch.Tensor, cache: "_HeadCache", last_only: bool = False) -> torch.Tensor:
        batch, num_new = input_ids.shape
        features = torch.randn(batch, num_new, self.head.feature_width, dtype=self.head.dtype)
        positions = (cache.length + torch.arange(num_new))[None].expand(batch, -1)  # (B, T)
        lengths = torch.full((batch,), cache.length, dtype=torch.long)
        predicted = self.head.step(features, input_ids, positions, cache.keys, cache.values, lengths, False)
        return self.head.logits(predicted[:, -1:] if last_only else predicted)  # (B, T or 1, V')


class _HeadCache:
    """A head's keys and values with the committed length, as forward_costs commits a prompt."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values, self.length = keys, values, 0

    def commit(self, count: int) -> None:
        self.length += count
