"""What both workers know about a request: the scheduler sends this once, on admission."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


@dataclass
class StepResult:
    rid: int
    new_tokens: list[int]        # accepted drafts + the verifier's token, cut at a stop / max_tokens
    num_drafted: int
    num_accepted: int
    finish_reason: str | None    # "stop" | "length" | None (still running)
    features: Any = None  # a torch.Tensor  # for a feature-conditioned draft: the target's final-norm states
    #                                       of the positions kept this step (not part of the message)

    def to_msg(self) -> list:
        return [self.rid, self.new_tokens, self.num_drafted, self.num_accepted, self.finish_reason]

    @classmethod
    def from_msg(cls, m) -> "StepResult":
        return cls(m[0], list(m[1]), m[2], m[3], m[4])
