"""`minedraft generate` sends PROMPT through the chat template by default on a chat model (its template ends a
turn with its end-of-sequence token), continues it as plain text on a base model or with --raw, and a prompt over
the limit is refused naming --max-prompt-tokens. Each case is refused before any worker starts, so what the
refusal counts (the prompt with or without the template) shows which path was taken, in a second."""

from __future__ import annotations

import shutil

import pytest

from minedraft.cli import main as cli
from minedraft.engine.chat import is_chat_model

TEMPLATE = ("{% for m in messages %}<eos>{{ m['role'] }}: {{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}<eos>assistant: {% endif %}")


@pytest.fixture(scope="module")
def chat_model(tiny_pair, tmp_path_factory):
    """The tiny target with a template that closes each turn with its eos: a chat model by the rule."""
    from transformers import AutoTokenizer
    d = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(tiny_pair.target, d)
    tok = AutoTokenizer.from_pretrained(str(d))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(d))
    return str(d)


def _refusal(capsys, *argv) -> str:
    rc = cli.main(["generate", "--draft", "suffix", "--max-prompt-tokens", "2", *argv,
                   "the class statement"])
    assert rc != 0
    return capsys.readouterr().err


def test_chat_model_gets_the_template_unless_raw(chat_model, capsys):
    from transformers import AutoTokenizer
    assert is_chat_model(AutoTokenizer.from_pretrained(chat_model), [0])
    assert "with the chat template" in _refusal(capsys, "--target", chat_model)
    raw = _refusal(capsys, "--target", chat_model, "--raw")
    assert "with the chat template" not in raw and "--max-prompt-tokens is 2" in raw, raw


def test_base_model_continues_the_prompt_unless_chat(tiny_pair, capsys):
    err = _refusal(capsys, "--target", tiny_pair.target)
    assert "with the chat template" not in err and "--max-prompt-tokens" in err, err
    assert "--system needs the chat template" in _refusal(capsys, "--target", tiny_pair.target, "--system", "Hi")


def test_bundled_pair_is_not_a_chat_model(capsys):
    err = _refusal(capsys)  # the README's first command keeps continuing text
    assert "with the chat template" not in err, err


def test_pulled_instruct_model_is_a_chat_model(capsys):
    from minedraft.models.hub import PullError, resolve
    try:
        resolve("smollm2-135m")
    except PullError:
        pytest.skip("smollm2-135m is not pulled")
    assert "with the chat template" in _refusal(capsys, "--model", "smollm2-135m")


def test_default_prompt_limit_error_names_the_flag_and_the_context(capsys):
    rc = cli.main(["generate", "--draft", "suffix", "--max-tokens", "8", "x " * 1100])
    err = capsys.readouterr().err
    assert rc != 0 and "--max-prompt-tokens" in err and "context 1024" in err, err
