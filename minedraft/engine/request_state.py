"""A request's life in the front end: validation, tokenization, and turning step results into output."""

from __future__ import annotations

import os
import time

from ..config import PROMPT_CHARS_PER_TOKEN, EngineConfig
from .detokenize import IncrementalDetokenizer
from ..errors import InvalidRequestError, check_text
from ..outputs import GenerationResult, RequestStats, StreamDelta
from ..sampling_params import SamplingParams, as_params
from ..ipc.messages import NewRequest
from ..ipc.messages import StepResult


# the setting behind each limit, as the embedded API and the command line spell it (the HTTP and ZeroMQ errors
# also carry the request field in `param`)
PROMPT_LIMIT = "EngineConfig.max_prompt_tokens, command line `--max-prompt-tokens`"
OUTPUT_LIMIT = "EngineConfig.max_tokens_limit, command line `serve --max-tokens-limit`"
KV_LIMIT = "EngineConfig.kv_cache_tokens / kv_cache_memory_fraction, command line `serve --kv-cache-tokens` / " \
           "`--kv-cache-memory-fraction`"


def make_request(rid: int, prompt, params: SamplingParams | dict | None, tokenizer, config: EngineConfig,
                 vocab_size: int) -> NewRequest:
    """Validate one request and tokenize it; raises InvalidRequestError with a message a user can act on."""
    params = as_params(params)
    if params.n != 1:
        raise InvalidRequestError(f"n={params.n} asks for several completions: use generate_choices or chat_choices",
                                  "n")
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty", "prompt")
        if len(prompt) > PROMPT_CHARS_PER_TOKEN * config.max_prompt_tokens:  # cheap guard before tokenizing
            raise InvalidRequestError(f"prompt is {len(prompt)} characters; the limit is about "
                                      f"{config.max_prompt_tokens} tokens ({PROMPT_LIMIT})", "prompt")
        check_text(prompt, "prompt", "prompt")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be ints in [0, {vocab_size})", "prompt")
    else:
        raise InvalidRequestError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}",
                                  "prompt")
    if not ids:
        raise InvalidRequestError("prompt has no tokens", "prompt")
    if len(ids) > config.max_prompt_tokens:
        raise InvalidRequestError(f"prompt has {len(ids)} tokens; the limit is {config.max_prompt_tokens} "
                                  f"({PROMPT_LIMIT})", "prompt")
    if params.logit_bias and params.logit_bias[-1][0] >= vocab_size:
        raise InvalidRequestError(f"logit_bias token id {params.logit_bias[-1][0]} is not in the vocabulary "
                                  f"[0, {vocab_size})", "logit_bias")
    if params.max_tokens > config.max_tokens_limit:
        raise InvalidRequestError(f"max_tokens={params.max_tokens} exceeds the engine's limit "
                                  f"{config.max_tokens_limit} ({OUTPUT_LIMIT})", "max_tokens")
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little")
    return NewRequest(rid, ids, params, seed)


class RequestState:
    def __init__(self, request_id: str, req: NewRequest, tokenizer):
        self.request_id, self.req = request_id, req
        self.detok = IncrementalDetokenizer(tokenizer, req.params.stop)
        self.stats = RequestStats(prompt_tokens=len(req.prompt_ids))
        self.arrival = time.perf_counter()
        self.finish_reason: str | None = None
        self.logprobs: list | None = [] if req.params.logprobs is not None else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def on_result(self, r: StepResult) -> StreamDelta:
        """Fold one verifier verdict into the request; the delta says what is new."""
        st = self.stats
        if st.steps == 0:
            st.ttft_s = time.perf_counter() - self.arrival
            st.cached_tokens = st.prompt_tokens - r.prefill_tokens
        st.steps += 1
        st.draft_tokens += r.num_drafted
        st.accepted_tokens += r.num_accepted
        before = len(self.detok.ids)
        new = r.new_tokens
        if r.finish_reason == "stop" and new:
            # the verifier stopped on a stop token (stop_token_ids or eos), the last one: its id belongs in
            # token_ids, its text does not (the same rule as a stop string: the trigger is never in `text`)
            text = self.detok.push(new[:-1], final=True)
            if not self.detok.stopped:  # a stop string earlier in this step wins; then the tokens end there
                self.detok.ids.append(new[-1])
        else:
            text = self.detok.push(new, final=r.finish_reason is not None)
        new_ids = self.detok.ids[before:]
        st.output_tokens = len(self.detok.ids)
        reason = "stop" if self.detok.stopped else r.finish_reason
        if reason:
            self.finish(reason)
        lps = None
        if self.logprobs is not None:  # one per token kept (a stop string may cut the step's tokens short)
            lps = list(r.logprobs or [])[:len(new_ids)]
            self.logprobs += lps
        return StreamDelta(self.request_id, text, new_ids, self.finished, self.finish_reason,
                           self.stats if self.finished else None, lps)

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.stats.latency_s = time.perf_counter() - self.arrival

    def result(self) -> GenerationResult:
        return GenerationResult(self.request_id, self.detok.text, list(self.detok.ids),
                                self.finish_reason or "abort", self.stats, self.logprobs)
