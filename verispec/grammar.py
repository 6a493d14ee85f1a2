"""Structured output: which tokens a JSON schema lets come next, for the target's p and the draft's q alike.

A `Grammar` belongs to one request. Its state is the request's committed tokens. `allowed()` is the mask
after them; `masks_along(drafts)` reads the masks at every draft position and leaves the state where it
was; `advance(tokens)` commits. Masks are boolean rows over the model's whole output width (ids past
the tokenizer's vocabulary are never allowed); `logits_to_probs(..., allowed=mask)` applies them before
any other transform, so the draft's q and the target's p are shaped by the same code.

Speculation stays lossless under a mask: the target's distribution is p masked and renormalised, and
the accept/reject rule reproduces any p from any q. Drafts the grammar forbids are cut before the verify
pass: a point-mass draft (a lookup) is cut at its first forbidden token, which is what verifying it would
do (p is 0 there, so the token is rejected and the residual is p itself); a sampled draft keeps that
token, whose rejection then draws from the residual max(p - q, 0), as the law requires.

The engine is llguidance, chosen by measurement (benchmarks/results/zen5/grammar): its mask over a whole
vocabulary costs little beside a forward, and it compiles a schema fast enough to do per request. xgrammar's
masks are faster still but it depends on triton (a GPU compiler, 1 GB); outlines-core compiles a schema too
slowly to do per request.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch


if TYPE_CHECKING:
    from verispec.models.loading import LoadedModel

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}  # response_format {"type": "json_object"}
# Documents are laid out as json.dumps does by default: `{"a": 1, "b": [2, 3]}`. Free whitespace would let a
# model spend its whole budget on newlines (a known failure of JSON grammars); a schema's own
# "x-guidance" options override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# Tokens a new grammar is walked ahead by before it is accepted (Grammar.walk_ahead): a lexer that cannot be built
# fails as the first value opens, so a request is refused with a 400, not ended on its second token.
CHECKED_TOKENS = 2


class SchemaError(ValueError):
    """A schema the grammar engine cannot compile; the message says why."""


class GrammarCompiler:
    """Compiles JSON schemas into per-request grammars over one tokenizer (built once: a pass over its vocabulary)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import llguidance.hf

        if not eos_token_ids:
            raise ValueError("structured output needs the model's end-of-sequence ids, to end a finished document")
        self.vocab_size = vocab_size  # the model's logits width (>= the tokenizer's vocabulary)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))

    def json_schema(self, schema: dict[str, Any]) -> "Grammar":
        """A fresh grammar for one request; SchemaError names what is wrong with the schema."""
        source = _grammar_source(json.dumps(schema))  # key order kept: properties come in the schema's order
        return self._grammar(source, "the JSON schema")

    def lark(self, source: str) -> "Grammar":
        """A fresh grammar from llguidance's Lark syntax (tool calls: text, or special tokens around JSON)."""
        import llguidance

        try:
            compiled = llguidance.grammar_from("lark", source)
        except ValueError as error:
            raise SchemaError(f"the grammar cannot be used: {error}") from None
        return self._grammar(compiled, "the grammar")

    def _grammar(self, source: str, what: str) -> "Grammar":
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer, source, log_level=0)
        if matcher.is_error():
            raise SchemaError(f"{what} cannot be used: {matcher.get_error()}")
        grammar = Grammar(matcher, self.vocab_size)
        try:  # the first masks, now: a grammar whose lexer fails on them would otherwise fail mid-request
            grammar.allowed()
            if not (matcher.is_error() or grammar.finished):
                grammar.walk_ahead(CHECKED_TOKENS)
        except RuntimeError as error:
            raise SchemaError(f"{what} cannot be used: {error}") from None
        if matcher.is_error() or grammar.finished:
            raise SchemaError(f"{what} admits no value (a schema that refers only to itself, say); nothing can be generated")
        return grammar


@functools.lru_cache(maxsize=256)
def _grammar_source(schema_json: str) -> str:
    """llguidance's grammar for a schema (cached: clients send the same schema with every request)."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema_json, defaults=JSON_LAYOUT)
    except ValueError as error:
        raise SchemaError(f"the JSON schema cannot be used: {error}") from None


class Grammar:
    """One request's constraint: its state follows the committed tokens."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    @property
    def finished(self) -> bool:
        """The document is complete: only an end-of-sequence id may follow."""
        return self._matcher.is_stopped()

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the tokens that may follow the current state."""
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)  # (ceil(V / 32) * 4,)
        bits = np.unpackbits(words, bitorder="little")[: self.vocab_size]  # (V,) bit i = token i
        if not bits.any():  # never for a valid state: an empty mask would make p all NaN
            raise RuntimeError(f"the grammar allows no next token: {self._matcher.get_error() or 'empty mask'}")
        return torch.from_numpy(bits.astype(bool))

    def walk_ahead(self, depth: int) -> None:
        """Take `depth` tokens, each the first the grammar allows, computing every mask on the way, and come back:
        a RuntimeError where the grammar fails on them (a pattern too complex for its lexer fails once the string
        opens, not at the first mask). The state is unchanged where none is raised."""
        walked = 0
        try:
            for _ in range(depth):
                if self.finished:
                    return
                self.advance([int(self.allowed().nonzero()[0])])
                walked += 1
            if not self.finished:
                self.allowed()
        finally:
            self.rollback(walked)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of tokens, in order, the grammar accepts from the current state (the state is unchanged)."""
        return self._matcher.validate_tokens(list(tokens)) if tokens else 0

    def masks_along(self, tokens: Sequence[int]) -> torch.Tensor:
        """(len(tokens) + 1, V) bool: the mask before each token and after the last; the state is unchanged.

        Only the last token may be one the grammar forbids (a sampled draft cut after it): the row after it
        repeats the row before and is never used, since that token is rejected with probability 1.
        """
        valid = self.valid_prefix(tokens)  # consuming a forbidden token would leave the matcher in an error state
        if valid < len(tokens) - 1:
            raise ValueError(f"draft token {tokens[valid]} at position {valid} is forbidden and not the last")
        masks = [self.allowed()]
        consumed = 0  # a finished matcher records no more tokens, so only these are rolled back
        for token in tokens[:valid]:
            if not self.finished:
                self._matcher.consume_token(token)
                consumed += 1
            masks.append(self.allowed())  # once finished: the end-of-sequence ids
        if valid < len(tokens):
            masks.append(masks[-1])
        self.rollback(consumed)
        return torch.stack(masks)  # (T + 1, V)

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit tokens (each must be allowed); tokens after the end of the document are ignored."""
        for token in tokens:
            if self.finished:
                return
            if not self._matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused committed token {token}: {self._matcher.get_error()}")

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens advances (drafting walks ahead and comes back)."""
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"the grammar could not roll back {num_tokens} tokens: {self._matcher.get_error()}")


def fit_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    """A (..., V) mask cut or padded (with False) to (..., width): a draft model's logits may be wider or narrower."""
    if mask.shape[-1] >= width:
        return mask[..., :width]
    return torch.nn.functional.pad(mask, (0, width - mask.shape[-1]), value=False)


_compilers: dict[tuple[int, tuple[int, ...]], GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def compiler_for(target: "LoadedModel", eos_token_ids: Sequence[int] | None = None) -> GrammarCompiler:
    """The grammar compiler for target's tokenizer and end ids (None: the model's own), built on first use (a pass
    over the whole vocabulary) and kept. SchemaError when the tokenizer cannot be used (not a fast tokenizer)."""
    eos = tuple(target.eos_token_ids if eos_token_ids is None else eos_token_ids)
    key = (id(target), eos)
    with _compilers_lock:
        if key not in _compilers:
            try:
                _compilers[key] = GrammarCompiler(target.tokenizer, target.model.vocab_size, eos)
            except ValueError as error:
                raise SchemaError(f"structured output is not available for this model: {error}") from None
        return _compilers[key]


def grammar_for(target: "LoadedModel", schema: dict[str, Any], eos_token_ids: Sequence[int] | None = None) -> Grammar:
    """A fresh grammar for one request to `target`; eos_token_ids end the document (None: the model's own).

    SchemaError for a schema the engine cannot compile.
    """
    return compiler_for(target, eos_token_ids).json_schema(schema)


def constraint_for(
    target: "LoadedModel", json_schema: dict[str, Any] | None, lark: str | None, eos_token_ids: Sequence[int] | None
) -> Grammar | None:
    """A request's grammar: from its JSON schema, or its Lark grammar (tool calls); None for neither."""
    if json_schema is not None:
        return grammar_for(target, json_schema, eos_token_ids)
    if lark is not None:
        return compiler_for(target, eos_token_ids).lark(lark)
    return None
