"""Admission: waiting prompts into free cache rows, whole or in chunks beside the decoding streams.

Prompts go in one at a time, first come first served, in row len(active). A batch-invariant target takes a
prompt's chunks inside the decoding step's own forward (`_packed_chunk`); any other takes them by prefills of
their own, on chunk boundaries (`_prefill_some`). Either way the prompts get their share of the streams' time
(`prefill_budget`, `cost_model.prompt_chunk`), and a short prompt goes in at once.
"""

from __future__ import annotations

import time

import torch

from verispec.core.requests import Sequence
from verispec.models.transformer import PREFILL_CHUNK
from verispec.cost_model import estimated_forward_seconds, moving_average, prompt_chunk

# While others decode, a step's prefill lasts at least this many of their decoding steps: a long prompt
# among streams makes their tokens at most 1.75x slower and goes in at 1 / 1.75 of its speed alone.
PREFILL_MIN_SHARE = 0.75
# A prompt whose rest goes in within this many of the streams' steps goes in at once: small chunks cost far more per
# prompt token than a prefill (the first tokens beside the streams cross the matrix kernels' small-row paths), and a
# pause of a few steps is brief. A prompt of thousands of tokens still goes in by chunks.
WHOLE_PROMPT_STEPS = 8
PACKED_FIRST_CHUNK = 8  # prompt tokens a decoding step carries before any prefill was timed
PACKED_MAX_CHUNK = 512  # the most prompt tokens one decoding step carries
# A share of rows with a recurring context is taken to hold this many steps; then the lookups are planned for every
# row again (and so asked, where that pays), so that text that starts to recur under a full batch is found.

  # a probe's row far behind in the draft cache sees only its latest tokens (restart_window)

def prefill_budget(
    step_seconds: float | None, token_seconds: float | None, prompts: int, decoding: int, left: int | None = None
) -> int:
    """Prompt tokens to feed in one step while `decoding` sequences decode and `prompts` prompts wait to go in.

    Requests share the model's time evenly, the waiting ones at least PREFILL_MIN_SHARE of a decoding
    step: a step's prefill lasts max(prompts / decoding, PREFILL_MIN_SHARE) decoding steps
    (step_seconds, measured) at token_seconds a prompt token (measured). So a burst of new requests
    goes in quickly, and one long prompt slows the streams by 1.75x at most. The prompt's `left`
    tokens go in at once where that lasts WHOLE_PROMPT_STEPS steps at most: a chunk of a few tokens
    costs the streams far more per token than a prefill does. Until both costs are measured, one chunk.
    """
    if step_seconds is None or token_seconds is None:
        return PREFILL_CHUNK
    if left is not None and left * token_seconds <= WHOLE_PROMPT_STEPS * step_seconds:
        return left
    share = max(prompts / decoding, PREFILL_MIN_SHARE)
    return max(1, int(step_seconds * share / token_seconds))


class Admission:
    """The scheduler's room for admitting prompts (a mixin of Scheduler: it reads the scheduler's target, cache,
    prefix cache, draft, controller and queues, and sets `_prefilling` and `active`)."""

    def _admit(self) -> None:
        """Prompts go in one at a time, first come first served, in row len(active) (chunked prefill).

        With nothing decoding, a prompt goes in whole. Else it gets the prompts' share of this step
        (see prefill_budget) and the rest in later steps, so the active streams keep flowing while a
        long prompt goes in, and a request starts decoding (its first token comes with the next
        step) as soon as its own prompt is in. Without chunked_prefill, every waiting prompt goes in
        whole before the next step. A prompt with nothing left to feed (one token, all of it in the
        prefix cache, another choice's copy) decodes at once. A failure on one prompt's behalf ends
        that request alone.
        """
        while True:
            if self._prefilling is None:
                if len(self.active) >= self.limits.max_batch_size:
                    break
                with self._lock:
                    if not self._waiting:
                        break
                    sequence = self._waiting.popleft()
                if sequence.handle.cancelled.is_set():
                    self._finish(sequence, "cancelled")
                    continue
                if not self._guarded(sequence, self._start_prefill, sequence):
                    continue
            sequence = self._prefilling
            decoding = len(self.active)
            if decoding and self.packs_prefill and sequence.prefilled < len(sequence.prompt_ids) - 1:
                break  # its chunks go in with the decoding steps' own forwards (_step)
            if not self._guarded(sequence, self._prefill_some, sequence, decoding):
                self._prefilling = None
                continue
            if sequence.prefilled < len(sequence.prompt_ids) - 1:
                break  # the rest after the next step
            self._prefilling = None
            if not self._guarded(sequence, self._begin_decoding, decoding, sequence):
                continue
            if decoding and self.chunked_prefill:
                break  # one prompt per step while others decode
        self._report_queue()

    def _prefill_some(self, sequence: Sequence, row: int) -> None:
        """Feed the prompt going in (row `row`): all of it, or this step's budget of it while others decode."""
        prompt = sequence.prompt_ids[:-1]
        if sequence.prefilled >= len(prompt):
            return
        started = time.perf_counter()
        hidden: list[torch.Tensor] | None = [] if self.feeds_head else None
        fed = self.target.model.prefill(
            prompt[sequence.prefilled :], self.cache.rows(row, row + 1),
            self._prefill_budget(sequence) if row and self.chunked_prefill else None, hidden_out=hidden,
        )
        if hidden:
            sequence.prompt_features.append((sequence.prefilled, torch.cat(hidden)))
        seconds = time.perf_counter() - started
        sequence.stats.prefill_seconds += seconds
        if fed:
            self._prefill_token_seconds = moving_average(self._prefill_token_seconds, seconds / fed, self.controller.settings.smoothing)
        sequence.prefilled += fed

    def _prefill_budget(self, sequence: Sequence) -> int:
        """Prompt tokens to feed this step while others decode: prefill_budget's, on chunk boundaries where
        the model is not batch-invariant (see Transformer.prefill)."""
        tokens = prefill_budget(
            self._step_seconds, self._prefill_token_seconds, 1 + self.num_waiting, len(self.active),
            len(sequence.prompt_ids) - 1 - sequence.prefilled,
        )
        if not self.target.model.batch_invariant:  # end on a chunk boundary
            end = -(-(sequence.prefilled + tokens) // PREFILL_CHUNK) * PREFILL_CHUNK
            tokens = end - sequence.prefilled
        return tokens

    def _start_prefill(self, sequence: Sequence) -> None:
        """Give the sequence row len(active), holding the longest prefix of its prompt the prefix cache has."""
        row = len(self.active)
        self.cache.lengths[row] = 0
        source = self._row_of(sequence.prompt_source)
        if source is not None:  # another choice of this request decodes: its prompt is in the cache
            sequence.prefilled = len(sequence.prompt_ids) - 1
            self.cache.copy_prefix(source, row, sequence.prefilled)
            sequence.stats.cached_prompt_tokens = sequence.prefilled
        elif self.prefix_cache is not None:
            view = self.cache.rows(row, row + 1)
            sequence.prefilled = self.prefix_cache.load(sequence.prompt_ids[:-1], view)
            sequence.stats.cached_prompt_tokens = sequence.prefilled
            if self.feeds_head and sequence.prefilled:  # the head's input for what was not computed again
                hidden = self.prefix_cache.hidden_states(sequence.prompt_ids[:-1], sequence.prefilled)
                if hidden is not None:
                    sequence.prompt_features.append((0, hidden))
        self._prefilling = sequence

    def _begin_decoding(self, row: int, sequence: Sequence) -> None:
        """The prompt is in (all but its last token): offer it to the prefix cache, set up drafting, decode."""
        prompt = sequence.prompt_ids
        if self.prefix_cache is not None:
            self.prefix_cache.store(prompt[:-1], self.cache.rows(row, row + 1), self._prompt_hidden(sequence))
            if self.metrics is not None:
                reused = sequence.stats.cached_prompt_tokens
                self.metrics.prefix_lookup(reused, len(prompt) - 1 - reused, self.prefix_cache.nbytes)
        if self.draft is not None:
            source = self._row_of(sequence.prompt_source)
            if source is not None:
                self.draft.share_prompt(source, row, len(prompt))
            else:
                self.draft.add(row, prompt, self._max_length(sequence))  # filled when the sequence first drafts
                for position, features in sequence.prompt_features if self.feeds_head else ():
                    self.draft.observe(row, position, features)
        sequence.prompt_features = []
        sequence.prompt_source = None  # copied or not, it is needed no more
        if self.own is not None:  # each sequence's own drafter (a lookup's state is its own)
            started = time.perf_counter()
            self.own.add(row, prompt, self._max_length(sequence))
            sequence.stats.prefill_seconds += time.perf_counter() - started
        self.active.append(sequence)

    def _max_length(self, sequence: Sequence) -> int:
        """The most tokens the sequence's rows hold: its prompt, its answer, and the last step's drafts."""
        return len(sequence.prompt_ids) + sequence.config.max_new_tokens + self.k_max + 1

    @staticmethod
    def _prompt_hidden(sequence: Sequence) -> torch.Tensor | None:
        """The target's last hidden states of the whole prompt but its last token, where a draft head was handed
        them all from the first position on (else None)."""
        if not sequence.prompt_features or sequence.prompt_features[0][0] != 0:
            return None
        parts, end = [], 0
        for position, features in sequence.prompt_features:
            if position != end:
                return None
            parts.append(features)
            end += len(features)
        return torch.cat(parts)

    def _packed_chunk(self, sequence: Sequence, verify_tokens: int, draft_seconds: float) -> list[int]:
        """The prompt tokens the step's forward over `verify_tokens` tokens carries for the sequence being admitted.

        The rest of the prompt where carrying it lengthens the step by WHOLE_PROMPT_STEPS steps at most. Else
        the prompts' share of the streams' time (as in prefill_budget: max(prompts / decoding, PREFILL_MIN_SHARE)
        of each step's drafting and its forward without the chunk), on average over steps, in chunks that are
        efficient by the measured cost of forwards of each size (prompt_chunk: none in some steps, so that a chunk
        pays for a kernel's jump); until a whole prefill was timed, PACKED_FIRST_CHUNK.
        """
        prompt = sequence.prompt_ids[:-1]
        left = len(prompt) - sequence.prefilled
        most = min(left, PACKED_MAX_CHUNK)
        if self._prefill_token_seconds is None:
            return prompt[sequence.prefilled : sequence.prefilled + min(most, PACKED_FIRST_CHUNK)]
        costs = {**self.controller.verify_cost, **self._packed_seconds}
        if most == left:  # a short prompt: at once, if that holds the streams up by WHOLE_PROMPT_STEPS steps at most
            step = draft_seconds + estimated_forward_seconds(costs, verify_tokens, self._prefill_token_seconds)
            carrying = draft_seconds + estimated_forward_seconds(costs, verify_tokens + left, self._prefill_token_seconds)
            if carrying <= (1 + WHOLE_PROMPT_STEPS) * step:
                return prompt[sequence.prefilled :]
        share = max((1 + self.num_waiting) / len(self.active), PREFILL_MIN_SHARE)
        size, sequence.chunk_credit = prompt_chunk(
            costs, verify_tokens, share, draft_seconds, self._prefill_token_seconds, most, sequence.chunk_credit,
            WHOLE_PROMPT_STEPS,
        )
        return prompt[sequence.prefilled : sequence.prefilled + size]

    def _carried(self, sequence: Sequence, chunk: list[int], hidden: torch.Tensor | None) -> None:
        """The step's forward carried `chunk` of the prompt going in (row len(active)): it is in the cache; once the
        whole prompt is, the sequence decodes from the next step."""
        row = len(self.active)
        self.cache.rows(row, row + 1).commit(len(chunk))
        if hidden is not None:
            sequence.prompt_features.append((sequence.prefilled, hidden))
        sequence.prefilled += len(chunk)
        if sequence.prefilled == len(sequence.prompt_ids) - 1:
            self._prefilling = None
            self._guarded(sequence, self._begin_decoding, row, sequence)
            self._report_queue()
