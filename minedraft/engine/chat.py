"""Chat messages -> prompt token ids, through the target tokenizer's own chat template.

The template belongs to the model (tokenizer_config.json / chat_template.jinja), so minedraft never
hard-codes a prompt format; a tokenizer without one is refused with a clear error instead of guessing.
"""

from __future__ import annotations

import dataclasses

from ..errors import InvalidRequestError, check_text
from ..sampling_params import SamplingParams, as_params

ROLES = ("system", "user", "assistant")

# ChatML, the format SmolLM2-Instruct uses; written into the bundled tiny pair's tokenizer configs (and by
# scripts/train/tiny_pair.py) so chat works on the default models. No default system prompt is injected.
CHATML_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _content(i: int, m: dict) -> str:
    """A message's text: a str, or OpenAI's list of {"type": "text", "text": ...} parts joined."""
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c:
        parts = []
        for p in c:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise InvalidRequestError(f"messages[{i}].content: only text parts are supported, got {p!r:.80}",
                                          "messages")
            parts.append(p["text"])
        return "".join(parts)
    raise InvalidRequestError(f"messages[{i}].content must be a string or a list of text parts, got {c!r:.80}",
                              "messages")


# keys an OpenAI client echoes back on an assistant message (model_dump of a reply), harmless at these values;
# any other key (name, tool_call_id, ...) asks for something the template does not do and is refused
_HARMLESS_KEYS = {"refusal": (None,), "tool_calls": (None, []), "function_call": (None,), "audio": (None,),
                  "annotations": (None, [])}


def normalize_messages(messages, max_messages: int | None = None) -> list[dict]:
    """Check OpenAI-style messages and return plain [{"role", "content": str}] dicts. max_messages is checked
    first, so an over-long list costs one len()."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects",
                                  "messages")
    if max_messages is not None and len(messages) > max_messages:
        raise InvalidRequestError(f"{len(messages)} messages; the limit is {max_messages} (max_prompt_tokens, `serve "
                                  "--max-prompt-tokens`: each message takes at least one token)", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object with role and content, got "
                                      f"{type(m).__name__}", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"messages[{i}].role must be one of {ROLES}, got {role!r:.40}", "messages")
        for key in m:
            if key not in ("role", "content") and not (key in _HARMLESS_KEYS and m[key] in _HARMLESS_KEYS[key]):
                raise InvalidRequestError(f"messages[{i}]: unrecognized or unsupported key {key!r:.40}; a message "
                                          "has role and content", "messages")
        out.append({"role": role, "content": check_text(_content(i, m), f"messages[{i}].content", "messages")})
    return out


def chat_prompt_ids(tokenizer, messages, max_prompt_tokens: int | None = None) -> list[int]:
    """Render messages with the tokenizer's chat template (add_generation_prompt=True) and tokenize.

    With max_prompt_tokens, everything that can be checked before the template runs is: the number of
    messages, their characters, then the rendered text's length (PROMPT_CHARS_PER_TOKEN per token, the bound
    a plain prompt string has), so a request that will be refused costs no more than the longest one that is
    not (rendering 12,000 messages and tokenizing 264k tokens to refuse them at 768 cost 0.15 s of event loop
    and 8-10 MB of memory never returned, issue 35)."""
    from ..config import PROMPT_CHARS_PER_TOKEN
    max_chars = None if max_prompt_tokens is None else PROMPT_CHARS_PER_TOKEN * max_prompt_tokens
    msgs = normalize_messages(messages, max_prompt_tokens)
    if max_chars is not None and sum(len(m["content"]) for m in msgs) > max_chars:
        raise InvalidRequestError(f"messages hold more than {max_chars} characters; the limit is "
                                  f"{PROMPT_CHARS_PER_TOKEN} per token of max_prompt_tokens={max_prompt_tokens}, "
                                  "`serve --max-prompt-tokens`", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("the target model's tokenizer has no chat template, so chat is unavailable; "
                                  "use a plain completion (generate / stream) or a model with a chat template")
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template may raise on content it does not accept (jinja raise_exception)
        raise InvalidRequestError(f"the chat template rejected these messages: {e}", "messages") from None
    if max_chars is not None and len(text) > max_chars:
        raise InvalidRequestError(f"the messages render to {len(text)} characters through the chat template; the "
                                  f"limit is {max_chars} ({PROMPT_CHARS_PER_TOKEN} per token of "
                                  f"max_prompt_tokens={max_prompt_tokens}, `serve --max-prompt-tokens`)", "messages")
    # The template writes any special tokens (bos, role markers) itself: add none on top.
    return tokenizer.encode(text, add_special_tokens=False)


def end_of_turn_id(tokenizer) -> int | None:
    """The special token the chat template closes an assistant turn with (<|im_end|> in ChatML, <|eot_id|> in
    Llama 3), read from the template itself; None if there is none or it is not a single special token.

    A chat model ends its answer with it, but its generation config may list only the plain eos (a base model
    with a chat template), so chat requests also stop on it, instead of running on into invented turns."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    probe = "minedraft-end-of-turn-probe"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": probe}],
                                             tokenize=False)
    except Exception:
        return None
    after = text.split(probe, 1)[1].strip() if probe in text else ""
    if not after:
        return None
    marker = after.split()[0]
    ids = tokenizer.encode(marker, add_special_tokens=False)
    special = set(getattr(tokenizer, "all_special_ids", ()))
    return ids[0] if len(ids) == 1 and ids[0] in special else None


def is_chat_model(tokenizer, eos_ids) -> bool:
    """A model tuned for chat: it has a chat template whose end-of-turn token is one of its end-of-sequence ids
    (SmolLM2-Instruct's <|im_end|>, Llama 3's <|eot_id|>), so it was trained to answer a turn and stop. A base
    model that merely carries a template (the bundled tiny pair) ends text otherwise and continues prompts."""
    eot = end_of_turn_id(tokenizer)
    return eot is not None and eot in set(eos_ids)


def chat_params(params, eot: int | None) -> SamplingParams:
    """The request's params, also stopping at the end-of-turn token (unless the caller asked to ignore eos)."""
    params = as_params(params)
    if eot is None or params.ignore_eos or eot in params.stop_token_ids:
        return params
    return dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, eot))
