"""Incremental detokenisation: a request's text as its tokens arrive, for the HTTP layer's streams and
the `generate` command line's terminal output."""

from __future__ import annotations

from typing import Sequence


class IncrementalText:
    """A completion's text as its tokens arrive. The whole completion is decoded each time (so
    multi-token characters and tokenizer spacing come out as offline decoding gives them) and only
    the new suffix is released; text that could begin a stop string, or an incomplete character, is
    held back until the next tokens decide it."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.token_ids: list[int] = []
        self.text = ""
        self.released = 0  # characters of self.text already sent
        self.stopped = False  # a stop string was found; self.text ends before it

    def add(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.text, self.stopped = text[: min(found)], True
            return self._release(len(self.text))
        self.text = text
        return self._release(len(text) - self._undecided_tail(text))

    def flush(self) -> str:
        return self._release(len(self.text))

    def _undecided_tail(self, text: str) -> int:
        incomplete = len(text) - len(text.rstrip("\ufffd"))  # a character cut between tokens
        longest = max((len(s) for s in self.stop), default=1)
        for k in range(min(len(text), longest - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                return max(k, incomplete)
        return incomplete

    def _release(self, end: int) -> str:
        end = max(end, self.released)  # sent text cannot be taken back
        delta = self.text[self.released: end]
        self.released = end
        return delta
