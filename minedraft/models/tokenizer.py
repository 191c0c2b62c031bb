"""The target's tokenizer for the caller's process, loaded without transformers' model stack.

`AutoTokenizer` imports torch and much of transformers (2-3 s of the caller's start-up, on the two cores the
workers are importing on at the same moment). A model folder with a `tokenizer.json` is read here with the
`tokenizers` library itself (the Rust tokenizer transformers wraps) and its chat template rendered with
transformers' own sandboxed Jinja renderer (`render_jinja_template`, which imports neither), so the token ids
and the rendered text are the ones AutoTokenizer gives (tests/models/test_tokenizer.py compares them).

A folder whose tokenizer_config asks for what only transformers applies on top (BOS/EOS added by a flag, the
clean-up of spaces, a slow tokenizer with no tokenizer.json) is loaded with AutoTokenizer, as before.
"""

from __future__ import annotations

import json
import os

# tokenizer_config keys under which transformers changes encode/decode beyond tokenizer.json; when one is set,
# the folder goes to AutoTokenizer
_APPLIED_BY_TRANSFORMERS = ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces", "legacy",
                            "add_prefix_space", "split_special_tokens")
_GENERIC = (None, "PreTrainedTokenizerFast", "TokenizersBackend")
_NAMED = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _content(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _chat_template(folder: str, config: dict) -> str | None:
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    t = config.get("chat_template")
    if isinstance(t, list):  # named templates: the default one
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) else None


class TextTokenizer:
    """What the engine, the CLI and the servers ask of a tokenizer: encode, decode, the chat template, the
    special tokens (the subset of transformers' tokenizer API they use, with the same meanings)."""

    def __init__(self, folder: str, config: dict):
        from tokenizers import Tokenizer
        self._tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        self.chat_template = _chat_template(folder, config)
        self.special_tokens_map = {k: _content(config[k]) for k in _NAMED if _content(config.get(k))}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra = list(extra.values()) if isinstance(extra, dict) else list(extra)
        named = list(self.special_tokens_map.values()) + [_content(t) for t in extra]
        ids = (self._tok.token_to_id(t) for t in named if t)
        self.all_special_ids = sorted({i for i in ids if i is not None})
        eos = self.special_tokens_map.get("eos_token")
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages, tokenize: bool = True, add_generation_prompt: bool = False, **kw):
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        from transformers.utils.chat_template_utils import render_jinja_template
        rendered, _ = render_jinja_template(conversations=[messages], chat_template=self.chat_template,
                                            add_generation_prompt=add_generation_prompt,
                                            **{**self.special_tokens_map, **kw})
        return self.encode(rendered[0], add_special_tokens=False) if tokenize else rendered[0]


def load_tokenizer(folder: str):
    """A TextTokenizer where the folder's files say everything (tokenizer.json, nothing transformers adds on
    top), else transformers' AutoTokenizer. Errors are the caller's to word (models/check.py)."""
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    config = {}
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
    # a model-specific tokenizer class may rebuild parts of tokenizer.json in transformers 5: only the generic ones
    plain = os.path.isfile(os.path.join(folder, "tokenizer.json")) and isinstance(config, dict) and \
        config.get("tokenizer_class") in _GENERIC and not any(config.get(k) for k in _APPLIED_BY_TRANSFORMERS)
    if plain:
        return TextTokenizer(folder, config)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
