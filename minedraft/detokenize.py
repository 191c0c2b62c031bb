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
            hits = [i for i in (full.find(s, lo) for s in self.stop) if i >= 0]
            if hits:
                full = full[:min(hits)]
                self.stopped = True
            elif not final:
                full = full[:len(full) - self._partial_stop(full)]
        delta = full[len(self.text):] if len(full) > len(self.text) else ""
        self.text += delta
        return delta
