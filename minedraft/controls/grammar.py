"""Structured output: a request's grammar (JSON Schema, regular expression or Lark) as a token mask per position,
through llguidance (why llguidance and not xgrammar: README "Structured output").

llguidance compiles the grammar against the tokenizer once per request and answers, for the current state, which
tokens may come next (a bitmask, computed lazily: only the lexer states the text reaches). Its matcher consumes
tokens and rolls back the last n, which is what speculation needs: drafts advance it, a rejected draft is rolled
back (controls/logits.py). Everything here runs only for requests that have a grammar.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..errors import InvalidRequestError
from ..grammar_check import compiled


@functools.lru_cache(maxsize=4)
def ll_tokenizer(tokenizer_dir: str, vocab_size: int, eos: tuple[int, ...]):
    """llguidance's view of a model folder's tokenizer (about a second to build: once per process)."""
    import llguidance.hf
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    return llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size, eos_token=list(eos))


class GrammarMatcher:
    """One request's grammar state: allowed() -> bool [V], consume(token) -> bool, rollback(n)."""

    def __init__(self, tokenizer, grammar: str, vocab_size: int, eos: tuple[int, ...]):
        import llguidance as llg
        self.m = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if self.m.is_error():
            raise InvalidRequestError(f"grammar failed to compile: {self.m.get_error()}")
        self.V = vocab_size
        self.eos = torch.tensor(eos, dtype=torch.long)

    def allowed(self) -> torch.Tensor:
        bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
        mask = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:self.V].astype(bool))
        if mask.shape[0] < self.V:  # ids past the tokenizer's (padding rows of the LM head) are never allowed
            mask = torch.cat([mask, torch.zeros(self.V - mask.shape[0], dtype=torch.bool)])
        if not mask.any():  # past the grammar's end (after eos, whose output is cut anyway): a defined law
            mask[self.eos] = True
        return mask

    def consume(self, token: int) -> bool:
        """Advance by one token if the grammar allows it (a refused token leaves the state as it was)."""
        if self.m.is_stopped() or self.m.validate_tokens([token]) != 1:
            return False
        return self.m.consume_token(token)

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)

    def accepting(self) -> bool:
        return self.m.is_accepting()


def matcher(kind: str, text: str, tokenizer_dir: str, vocab_size: int, eos) -> GrammarMatcher:
    eos = tuple(sorted(eos))
    return GrammarMatcher(ll_tokenizer(tokenizer_dir, vocab_size, eos), compiled(kind, text), vocab_size, eos)
