"""Incremental detokenization and stop strings.

Text is only emitted once it is stable: a byte-level tokenizer can end mid-way through a multi-byte character
(decoded as U+FFFD), so such a tail waits for the token that completes it. Streaming and `generate` share this
object, so the concatenated stream equals the final text by construction.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""            # emitted so far
        self.stopped = False      # a stop string was found; text is cut before it

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _first_completed(self, text: str, lo: int) -> tuple[int, int] | None:
        """(start, end) of the stop string that completes first in text[lo:], so the cut does not depend on
        how the tokens were chunked into pushes."""
        best = None
        for s in self.stop:
            i = text.find(s, lo)
            if i >= 0 and (best is None or (i + len(s), i) < (best[1], best[0])):
                best = (i, i + len(s))
        return best

    def _trim_ids(self, before: int, lo: int, end: int) -> None:
        """Keep only the tokens up to the one that completes the stop string: the same ids whatever k was."""
        for n in range(before + 1, len(self.ids) + 1):
            text = self.tokenizer.decode(self.ids[:n], skip_special_tokens=True)
            if len(text) >= end and self._first_completed(text[:end], lo) is not None:
                del self.ids[n:]
                return

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of text that could begin a stop string: held back until resolved."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the newly stable text (possibly "")."""
        if self.stopped:
            return ""
        before = len(self.ids)
        self.ids.extend(new_ids)
        full = self._decode()
        if not final:
            while full.endswith("\ufffd"):
                full = full[:-1]
        if not full.startswith(self.text):  # a tokenizer merged across the boundary: keep what was emitted
            full = self.text + full[len(self.text):]
        if self.stop:
            # search from a little before the old end, so a stop string spanning two pushes is seen
            lo = max(0, len(self.text) - max(map(len, self.stop)) + 1)
            hit = self._first_completed(full, lo)
            if hit is not None:
                start, end = hit
                full = full[:start]
                self.stopped = True
                self._trim_ids(before, lo, end)
            elif not final:
                full = full[:len(full) - self._partial_stop(full)]
        delta = full[len(self.text):] if len(full) > len(self.text) else ""
        self.text += delta
        return delta
