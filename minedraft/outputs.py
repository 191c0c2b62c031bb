"""What a request gives back: a whole result, or deltas while streaming."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0      # of the prompt, found in the prefix cache (not computed)
    output_tokens: int = 0
    steps: int = 0              # speculative steps this request took part in
    draft_tokens: int = 0       # tokens proposed by the drafter
    accepted_tokens: int = 0    # of those, accepted by the verifier
    ttft_s: float = 0.0         # time to first token
    latency_s: float = 0.0      # arrival to finish

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per step (accepted drafts plus the verifier's own token)."""
        return self.output_tokens / self.steps if self.steps else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted_length"] = self.mean_accepted_length
        return d


@dataclass
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str          # "stop" | "length" | "abort"
    stats: RequestStats = field(default_factory=RequestStats)
    # with SamplingParams(logprobs=N): per token of token_ids [logprob, [[id, logprob], ...N most likely]] under the
    # target's raw distribution (sampling/logprobs.py)
    logprobs: list | None = None

    def to_dict(self) -> dict:
        d = {"request_id": self.request_id, "text": self.text, "token_ids": list(self.token_ids),
             "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            d["logprobs"] = self.logprobs
        return d


@dataclass
class StreamDelta:
    request_id: str
    text: str                   # newly decoded text (may be "" while a multi-byte char is incomplete)
    token_ids: list[int]        # newly accepted tokens
    finished: bool = False
    finish_reason: str | None = None
    stats: RequestStats | None = None  # set on the final delta
    logprobs: list | None = None       # with SamplingParams(logprobs=N): one entry per token of token_ids
