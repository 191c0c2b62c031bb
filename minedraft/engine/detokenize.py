"""Incremental detokenization and stop strings.

Text is only emitted once it is stable: a byte-level tokenizer can end mid-way through a multi-byte character
(decoded as U+FFFD), so such a tail waits for the token that completes it. Streaming and `generate` share this
object, so the concatenated stream equals the final text by construction.

Stop strings are matched by one automaton over all of them (Aho-Corasick), run from the state at the end of
the emitted text over the new tail only: a push costs O(held-back + new characters) whatever the number of stop
strings, and building the automaton costs O(their total length), which SamplingParams bounds
(MAX_STOP_STRINGS x MAX_STOP_CHARS). A naive check costs stops x length per push, on the event loop.
"""

from __future__ import annotations

from collections import deque


class StopMatcher:
    """Aho-Corasick automaton over stop strings, by character.

    A state is the longest tail of the text read so far that begins some stop string; its depth is that tail's
    length (what must be held back), and ends[state] the length of the longest stop string ending there (0: none).
    """

    def __init__(self, stops):
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.ends = [0]
        for s in stops:
            cur = 0
            for ch in s:
                nxt = self.goto[cur].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto.append({})
                    self.depth.append(self.depth[cur] + 1)
                    self.ends.append(0)
                    self.goto[cur][ch] = nxt
                cur = nxt
            self.ends[cur] = len(s)
        self.fail = [0] * len(self.goto)
        queue = deque(self.goto[0].values())
        while queue:  # breadth first: a state's fallback is shallower, so already complete
            u = queue.popleft()
            for ch, v in self.goto[u].items():
                f = self.fail[u]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                self.fail[v] = self.goto[f].get(ch, 0)
                if not self.ends[v]:
                    self.ends[v] = self.ends[self.fail[v]]
                queue.append(v)

    def step(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)

    def scan(self, state: int, text: str) -> tuple[int, list[int]]:
        """Feed text from state. Returns (index just past the first completed stop string, or -1; the state after
        each character read)."""
        states = []
        for i, ch in enumerate(text):
            state = self.step(state, ch)
            states.append(state)
            if self.ends[state]:
                return i + 1, states
        return -1, states


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.matcher = StopMatcher(stop) if stop else None
        self._state = 0           # the matcher's state at the end of self.text
        self.ids: list[int] = []
        self.text = ""            # emitted so far
        self.stopped = False      # a stop string was found; text is cut before it

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _trim_ids(self, before: int) -> None:
        """Keep only the tokens up to the first one whose text holds a stop string: the same ids whatever k was.
        (Each prefix is decoded on its own: a decode of more tokens may space earlier text differently.)"""
        base = len(self.text)
        decode = lambda n: self.tokenizer.decode(self.ids[:n], skip_special_tokens=True)  # noqa: E731
        # the stop may end in an earlier push's token whose text was held back (a possible stop prefix, or a
        # partial character): start at the first token with text past what was emitted
        lo = before + 1
        while lo > 1 and len(decode(lo - 1)) > base:
            lo -= 1
        for n in range(lo, len(self.ids) + 1):
            if self.matcher.scan(self._state, decode(n)[base:])[0] >= 0:
                del self.ids[n:]
                return

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
        base = len(self.text)
        states: list[int] = []
        if self.matcher is not None:
            # only the tail after the emitted text: earlier text held no stop string nor the start of one
            # beyond what the state remembers
            m = self.matcher
            hit, states = m.scan(self._state, full[base:])
            if hit >= 0:
                end = base + hit
                full = full[:end - m.ends[states[-1]]]
                self.stopped = True
                self._trim_ids(before)
            elif not final and states:
                full = full[:len(full) - m.depth[states[-1]]]  # what could still begin a stop string waits
        delta = full[base:] if len(full) > base else ""
        if delta and states:
            self._state = states[len(delta) - 1]
        self.text += delta
        return delta
