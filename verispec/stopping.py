"""Incremental detokenization with stop strings.

Text is released to a stream only when it is final: never half a UTF-8 character, and never the
start of what may become a stop string.
"""

from __future__ import annotations

from typing import Callable


class TextAssembler:
    def __init__(self, decode: Callable[[list[int]], str], stop_strings: tuple[str, ...] = ()) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.decode = decode
        self.stop_strings = stop_strings
        self.hold_back = max((len(s) for s in stop_strings), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # text so far, cut at the stop string once one is found
        self.emitted = 0  # characters of self.text already released
        self.stopped = False
        self.stop_token_count = 0  # tokens kept when a stop string ended the text

    def add(self, token_ids: list[int]) -> None:
        """Append tokens one at a time (a stop string may end the text mid-step)."""
        for token in token_ids:
            if self.stopped:
                return
            self.token_ids.append(token)
            text = self.decode(self.token_ids)
            search_from = max(0, len(self.text) - self.hold_back - 1)
            cut = min((i for s in self.stop_strings if (i := text.find(s, search_from)) >= 0), default=-1)
            if cut >= 0:
                self.text = text[:cut]
                self.stopped = True
            else:
                self.text = text

    def add_step(self, token_ids: list[int], eos_token_ids: frozenset[int] | set[int], max_tokens: int) -> str | None:
        """Add one decoding step's tokens: at most max_tokens in all, through the first eos id.

        Returns why the text is done ("stop": an eos id or a stop string; "length": max_tokens), or None.
        """
        kept = token_ids[: max_tokens - len(self.token_ids)]
        eos_at = next((i for i, t in enumerate(kept) if t in eos_token_ids), None)
        if eos_at is not None:
            kept = kept[: eos_at + 1]
        self.add(kept)
        if eos_at is not None or self.stopped:
            return "stop"
        return "length" if len(self.token_ids) >= max_tokens else None

    def release(self, final: bool = False) -> str:
        """New text that can no longer change; everything left when final."""
        end = len(self.text)
        if not (final or self.stopped):
            end -= self.hold_back
            while end > self.emitted and self.text[end - 1] == "\ufffd":  # an unfinished UTF-8 sequence
                end -= 1
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
