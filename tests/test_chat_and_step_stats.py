"""Chat message rendering (no engine needed) and StepStats, the verdict listener behind /metrics and the
dashboard, on hand-made verdict messages; plus the scheduler's listener list keeping the one-hook form."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from minedraft.chat import CHATML_TEMPLATE, chat_params, chat_prompt_ids, end_of_turn_id, normalize_messages
from minedraft.config import DEFAULT_DRAFT, DEFAULT_TARGET
from minedraft.errors import InvalidRequestError
from minedraft.sampling_params import SamplingParams
from minedraft.step_stats import StepStats


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


def test_overlong_messages_refused_before_rendering(tok):
    with pytest.raises(InvalidRequestError, match="characters"):
        chat_prompt_ids(tok, [{"role": "user", "content": "x" * 101}], max_chars=100)


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


def _verdict(batch, results, draft, verify):
    return {"batch": batch, "results": [[i, [], d, a, None] for i, (d, a) in enumerate(results)],
            "draft_t0": draft[0], "draft_t1": draft[1], "t0": verify[0], "t1": verify[1]}


def test_step_stats_positions_times_and_timeline():
    s = StepStats(4, timeline_s=1.0)
    steps = []
    s.subscribers.append(steps.append)
    s(_verdict(0, [(4, 2), (4, 4), (4, 0)], (10.0, 10.1), (10.1, 10.4)))  # idle before: step from draft start
    s(_verdict(1, [(4, 1)], (10.1, 10.3), (10.4, 10.6)))                  # overlapped: from the last verdict
    assert s.drafted_by_pos == [4, 4, 4, 4]
    assert s.accepted_by_pos == [3, 2, 1, 1]
    assert s.acceptance_by_position() == [0.75, 0.5, 0.25, 0.25]
    a, b = steps
    assert (a.drafted, a.accepted, b.drafted, b.accepted) == (12, 6, 4, 1)
    assert a.step_s == pytest.approx(0.4) and a.overlap == pytest.approx(0.3 / 0.4)
    assert b.step_s == pytest.approx(0.2) and b.overlap == pytest.approx(1.0)
    assert len(s.recent(1.0, 10.6)) == 4
    s(_verdict(0, [(4, 4)], (12.0, 12.1), (12.1, 12.2)))  # 1.6 s later: the old intervals leave the ring
    assert [iv[2] for iv in s.timeline] == [12.0, 12.1]
    assert s.recent(0.05, 12.2) == [("verifier", 0, 12.1, 12.2)]


def test_step_stats_grows_past_initial_k():
    s = StepStats(2)
    s(_verdict(0, [(3, 3)], (0, 1), (1, 2)))
    assert s.drafted_by_pos == [1, 1, 1] and s.accepted_by_pos == [1, 1, 1]


def test_scheduler_listener_list_keeps_on_verdict_hook():
    from minedraft.async_scheduler import AsyncScheduler
    sched = AsyncScheduler.__new__(AsyncScheduler)  # only the listener plumbing, no sockets
    sched.verdict_listeners, sched._hook = [], None
    other, first, second = (lambda m: None), (lambda m: None), (lambda m: None)
    sched.verdict_listeners.append(other)
    sched.on_verdict = first
    sched.on_verdict = second  # replaces the hook, not the other listeners
    assert sched.verdict_listeners == [other, second] and sched.on_verdict is second
    sched.on_verdict = None
    assert sched.verdict_listeners == [other]
