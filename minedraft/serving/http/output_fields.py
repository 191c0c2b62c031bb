"""The OpenAI fields for output control (penalties, logit_bias, logprobs, response_format) and minedraft's
extensions (repetition_penalty, regex, grammar, speculate, draft_budget) -> SamplingParams keywords; and logprobs
in OpenAI's response shapes (chat: choices[].logprobs.content; completions: choices[].logprobs.tokens /
token_logprobs / top_logprobs / text_offset).
"""

from __future__ import annotations

import functools

OPENAI_LIMIT_COMPLETION_LOGPROBS = 20  # OpenAI documents 5 for completions; the chat limit, 20, is taken for both
# body field -> SamplingParams field, taken as they are (SamplingParams checks them and names the field)
_PLAIN = {"presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
          "repetition_penalty": "repetition_penalty", "logit_bias": "logit_bias", "regex": "regex",
          "grammar": "grammar", "speculate": "speculate", "draft_budget": "draft_budget"}
FIELDS = set(_PLAIN) | {"response_format", "logprobs", "top_logprobs"}


class BadField(Exception):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def control_kwargs(body: dict, chat: bool) -> dict:
    """SamplingParams keywords for the control fields present in body (None means absent, as OpenAI reads it)."""
    kw = {dst: body[src] for src, dst in _PLAIN.items() if body.get(src) is not None}
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise BadField("'response_format' must be an object with a 'type'", "response_format")
        t = rf["type"]
        if t == "json_object":
            kw["json_schema"] = {"type": "object"}
        elif t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise BadField("'response_format.json_schema' must be an object with a 'schema' object",
                               "response_format")
            kw["json_schema"] = js.get("schema", {})
        elif t != "text":
            raise BadField(f"unknown response_format type {t!r} (text, json_object or json_schema)",
                           "response_format")
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise BadField("'logprobs' must be a boolean on chat completions", "logprobs")
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
                raise BadField(f"'top_logprobs' must be an int in [0, 20], got {top!r}", "top_logprobs")
            if top and not lp:
                raise BadField("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if lp:
            kw["logprobs"] = top or 0
    else:
        if top not in (None, 0):
            raise BadField("'top_logprobs' is a chat field; completions take 'logprobs': N", "top_logprobs")
        if lp is None or lp is False:  # false: what some clients send for "none"
            return kw
        if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= OPENAI_LIMIT_COMPLETION_LOGPROBS:
            raise BadField(f"'logprobs' must be an int in [0, {OPENAI_LIMIT_COMPLETION_LOGPROBS}], got {lp!r}",
                           "logprobs")
        kw["logprobs"] = lp
    return kw


# SamplingParams field -> the body field a client names (response_format's two become one)
PARAM_NAMES = {"json_schema": "response_format"}


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (printable stand-ins for the 256 bytes) back to bytes."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """A token id's text and bytes, as OpenAI reports them (cached per id)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, tid: int) -> tuple[str, list[int]]:
        got = self.cache.get(tid)
        if got is None:
            piece = self.tok.convert_ids_to_tokens(tid) or ""
            dec = _byte_decoder()
            if piece and all(ch in dec for ch in piece):  # byte-level BPE: the exact bytes, even of half a char
                raw = bytes(dec[ch] for ch in piece)
            else:
                raw = self.tok.decode([tid]).encode("utf-8")
            got = self.cache[tid] = (raw.decode("utf-8", errors="replace"), list(raw))
            if len(self.cache) > 1 << 16:
                self.cache.clear()
        return got


def chat_logprobs(text_of: TokenText, ids: list[int], lps: list) -> dict:
    content = []
    for tid, (lp, top) in zip(ids, lps):
        s, b = text_of(tid)
        content.append({"token": s, "logprob": lp, "bytes": b,
                        "top_logprobs": [{"token": text_of(i)[0], "logprob": v, "bytes": text_of(i)[1]}
                                         for i, v in top]})
    return {"content": content, "refusal": None}


def completion_logprobs(text_of: TokenText, ids: list[int], lps: list, offset0: int = 0) -> dict:
    """offset0: the text offset of the first token (streaming: what earlier chunks held)."""
    tokens, offsets, off = [], [], offset0
    for tid in ids:
        s = text_of(tid)[0]
        tokens.append(s)
        offsets.append(off)
        off += len(s)
    tops = []
    for _, top in lps:
        d: dict[str, float] = {}
        for i, v in top:
            d.setdefault(text_of(i)[0], v)  # two ids with one text: the likelier one (top is sorted)
        tops.append(d)
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in lps], "top_logprobs": tops, "text_offset": offsets}
