"""Chat message rendering through the tokenizer's chat template (no engine needed)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from minedraft.engine.chat import CHATML_TEMPLATE, chat_params, chat_prompt_ids, end_of_turn_id, normalize_messages
from minedraft.config import DEFAULT_DRAFT, DEFAULT_TARGET
from minedraft.errors import InvalidRequestError
from minedraft.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEFAULT_TARGET, local_files_only=True)


def test_bundled_tokenizers_carry_chatml(tok):
    draft = AutoTokenizer.from_pretrained(DEFAULT_DRAFT, local_files_only=True)
    assert tok.chat_template == draft.chat_template == CHATML_TEMPLATE
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}]
    text = tok.decode(chat_prompt_ids(tok, msgs))
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA"
                    "<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n")


def test_text_parts_are_joined(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]}]
    assert chat_prompt_ids(tok, parts) == chat_prompt_ids(tok, [{"role": "user", "content": "abcd"}])


@pytest.mark.parametrize("messages,match", [
    ([], "non-empty list"), ("hi", "non-empty list"), ([["user", "hi"]], r"messages\[0\] must be an object"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\].role"), ([{"role": "user"}], r"messages\[0\].content"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": 5}], r"messages\[1\].content"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
])
def test_malformed_messages_refused(messages, match):
    with pytest.raises(InvalidRequestError, match=match):
        normalize_messages(messages)


def test_tokenizer_without_template_refused(tok):
    bare = AutoTokenizer.from_pretrained(DEFAULT_TARGET, local_files_only=True)
    bare.chat_template = None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        chat_prompt_ids(bare, [{"role": "user", "content": "hi"}])


def test_overlong_messages_refused_before_rendering(tok, monkeypatch):
    rendered = []
    real = type(tok).apply_chat_template
    monkeypatch.setattr(type(tok), "apply_chat_template",
                        lambda self, *a, **k: rendered.append(1) or real(self, *a, **k))
    with pytest.raises(InvalidRequestError, match="characters"):
        chat_prompt_ids(tok, [{"role": "user", "content": "x" * 1601}], max_prompt_tokens=100)
    # the attack of issue 35: many one-character messages, whose content alone is short, refused by their count
    with pytest.raises(InvalidRequestError, match="12000 messages; the limit is 100 .max_prompt_tokens"):
        chat_prompt_ids(tok, [{"role": "user", "content": "x"}] * 12_000, max_prompt_tokens=100)
    assert not rendered, "refused only after running the chat template"
    # under both limits, but the rendered text is over 16 characters a token: refused before tokenizing
    encoded = []
    monkeypatch.setattr(type(tok), "encode", lambda self, *a, **k: encoded.append(1))
    with pytest.raises(InvalidRequestError, match="render to .* characters"):
        chat_prompt_ids(tok, [{"role": "user", "content": "x"}] * 100, max_prompt_tokens=100)
    assert not encoded


@pytest.mark.parametrize("extra, ok", [({"name": "bob"}, False), ({"tool_call_id": "x"}, False),
                                       ({"contents": "typo"}, False), ({"refusal": None}, True),
                                       ({"tool_calls": []}, True), ({"refusal": "no"}, False)])
def test_unknown_message_keys_refused(tok, extra, ok):
    msgs = [{"role": "user", "content": "hi", **extra}]
    if ok:
        assert normalize_messages(msgs) == [{"role": "user", "content": "hi"}]
    else:
        with pytest.raises(InvalidRequestError, match="unrecognized or unsupported key"):
            normalize_messages(msgs)


def test_end_of_turn_token_read_from_the_template(tok):
    # the tiny tokenizer spells <|im_end|> in several ordinary pieces: no single token to stop on
    assert end_of_turn_id(tok) is None
    special = AutoTokenizer.from_pretrained(DEFAULT_TARGET, local_files_only=True)
    special.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    eot = special.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_id(special) == eot
    special.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|endoftext|>"
                             "{% endfor %}")  # a template whose turns end with the (special) eos
    assert end_of_turn_id(special) == special.eos_token_id


def test_chat_params_add_the_end_of_turn_stop():
    assert chat_params(None, 7).stop_token_ids == (7,)
    assert chat_params({"stop_token_ids": [3], "max_tokens": 5}, 7) == SamplingParams(stop_token_ids=(3, 7),
                                                                                         max_tokens=5)
    assert chat_params(SamplingParams(ignore_eos=True), 7).stop_token_ids == ()  # the caller wants it all
    assert chat_params(SamplingParams(stop_token_ids=(7,)), 7).stop_token_ids == (7,)
    assert chat_params({"seed": 1}, None) == SamplingParams(seed=1)
    with pytest.raises(InvalidRequestError):
        chat_params({"temperature": -1}, 7)
