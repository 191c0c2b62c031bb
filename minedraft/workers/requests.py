"""What both workers know about a request: the scheduler sends this once, on admission."""

from __future__ import annotations

from dataclasses import dataclass

from ..sampling_params import SamplingParams


@dataclass
class NewRequest:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # always set: the scheduler draws one when the caller gave none

    def cache_tokens(self, max_k: int) -> int:
        """Positions to reserve: prompt, every output token, and the k drafts in flight past them."""
        return len(self.prompt_ids) + self.params.max_tokens + max_k + 1

    def to_msg(self) -> list:
        return [self.rid, self.prompt_ids, self.params.to_dict(), self.seed]

    @classmethod
    def from_msg(cls, m: list) -> "NewRequest":
        return cls(m[0], list(m[1]), SamplingParams.from_dict(m[2]), m[3])
