"""The caller's tokenizer (models/tokenizer.py) against transformers' AutoTokenizer on the same folder: the same ids,
the same decoded text, the same rendered chat, the same special tokens; and it loads without torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from minedraft.config import DEFAULT_TARGET
from minedraft.models import hub
from minedraft.models.tokenizer import TextTokenizer, load_tokenizer

TEXTS = ["The while statement is used for", "", "  two  spaces\tand a tab\n\nnew lines", "ünïcödé — “quotes” 日本語 🙂",
         "def f(x):\n    return x ** 2  # comment", "<|im_start|>user\nspecial tokens in the text<|im_end|>",
         "<|endoftext|> at the start", "12345 678.9 -0.5e3", "a" * 300]
CHATS = [[{"role": "user", "content": "Explain recursion briefly."}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi <|im_end|> there"},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "ünïcödé?"}]]


def _folders(tiny_pair):
    out = [DEFAULT_TARGET, tiny_pair.target]
    if hub.is_pulled("smollm2-135m"):
        out.append(hub.resolve("smollm2-135m")[0])
    return out


def test_same_ids_text_and_chat_as_autotokenizer(tiny_pair):
    for folder in _folders(tiny_pair):
        ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder, local_files_only=True)
        assert isinstance(ours, TextTokenizer), folder   # these folders need nothing transformers adds
        assert ours.eos_token_id == theirs.eos_token_id, folder
        assert ours.all_special_ids == sorted(theirs.all_special_ids), folder
        assert len(ours) == len(theirs), folder
        for text in TEXTS:
            for special in (True, False):
                ids = ours.encode(text, add_special_tokens=special)
                assert ids == theirs.encode(text, add_special_tokens=special), (folder, text, special)
                for skip in (True, False):
                    assert ours.decode(ids, skip_special_tokens=skip) == \
                        theirs.decode(ids, skip_special_tokens=skip), (folder, text, skip)
            assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
        assert ours.convert_ids_to_tokens(3) == theirs.convert_ids_to_tokens(3)
        assert bool(ours.chat_template) == bool(theirs.chat_template), folder
        if ours.chat_template:
            for chat in CHATS:
                for gen in (True, False):
                    kw = dict(tokenize=False, add_generation_prompt=gen)
                    assert ours.apply_chat_template(chat, **kw) == theirs.apply_chat_template(chat, **kw), folder
                assert ours.apply_chat_template(chat, add_generation_prompt=True) == \
                    list(theirs.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))


def test_a_folder_that_needs_transformers_goes_to_autotokenizer(tmp_path):
    """A flag that transformers applies on top of tokenizer.json (here: add a BOS) must not be dropped."""
    import shutil
    shutil.copytree(DEFAULT_TARGET, tmp_path / "m")
    cfg_path = tmp_path / "m" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = True
    cfg_path.write_text(json.dumps(cfg))
    tok = load_tokenizer(str(tmp_path / "m"))
    assert not isinstance(tok, TextTokenizer)
    assert tok.encode("the for statement") == \
        AutoTokenizer.from_pretrained(str(tmp_path / "m"), local_files_only=True).encode("the for statement")


def test_the_callers_process_loads_neither_torch_nor_transformers_models():
    """What the caller imports to start an engine and check a model folder (start-up: issue 43)."""
    code = ("import sys; import minedraft, minedraft.engine.engine, minedraft.cli.main, minedraft.serving.launch; "
            "from minedraft.models.check import check_pair; from minedraft.config import DEFAULT_TARGET, DEFAULT_DRAFT; "
            "tok, v, eos = check_pair(DEFAULT_TARGET, DEFAULT_DRAFT); tok.encode('the'); "
            "print(sorted(m for m in ('torch', 'transformers.modeling_utils') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
