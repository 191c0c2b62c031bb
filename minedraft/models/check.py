"""Checks a model directory in the parent process, before any worker is spawned, so a wrong path, an unsupported
architecture or a damaged weights file fails in a second with one sentence naming the directory, instead of
after a worker has loaded weights (or with a tokenizer's message that names neither the directory nor the
problem).

Weights are checked with the `safetensors` library's own header reader (safe_open): it memory-maps the file and
refuses a header that is malformed or a file that does not cover every tensor the header lists (a truncated
copy), without reading the tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # what runner/model_runner.py can run


class ModelDirError(ValueError):
    """A model directory cannot be used; the message names it and says why."""


def _weights(d: Path, role: str) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelDirError(f"{role} model index {index} cannot be read: {e}") from None
        missing = [s for s in shards if not (d / s).is_file()]
        if missing:
            raise ModelDirError(f"{role} model directory {d} lacks weight shard(s) {', '.join(missing)} listed in "
                                f"{index.name}")
        return [d / s for s in shards]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        if (d / "pytorch_model.bin").is_file():
            return []  # a pickled checkpoint: nothing cheap to check, transformers reports damage itself
        raise ModelDirError(f"{role} model directory {d} has no weights (no *.safetensors or pytorch_model.bin "
                            "file)")
    return files


def check_safetensors(path: Path, role: str) -> None:
    from safetensors import SafetensorError, safe_open
    if not os.access(path, os.R_OK):
        raise ModelDirError(f"{role} weights file {path} is not readable (permissions)")
    try:
        with safe_open(str(path), framework="numpy") as f:
            f.keys()
    except (SafetensorError, OSError) as e:
        raise ModelDirError(f"{role} weights file {path} is damaged or truncated ({e})") from None


def check_model_dir(path: str, role: str) -> dict:
    """Config present with a supported model_type, weights present and whole. Returns the parsed config."""
    d = Path(path)
    if not d.is_dir():
        raise ModelDirError(f"{role} model directory {d} does not exist or is not a directory")
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise ModelDirError(f"{role} model directory {d} has no config.json (expected a Hugging Face model "
                            "directory: config.json, *.safetensors weights and tokenizer files)")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelDirError(f"{role} model config {cfg_file} cannot be read as JSON ({e})") from None
    kind = cfg.get("model_type") if isinstance(cfg, dict) else None
    if kind not in SUPPORTED_TYPES:
        raise ModelDirError(f"{role} model in {d} is of type {kind!r}, which minedraft cannot run (supported: "
                            f"{', '.join(SUPPORTED_TYPES)})")
    for f in _weights(d, role):
        check_safetensors(f, role)
    return cfg


def load_tokenizer(path: str, role: str = "target"):
    from .tokenizer import load_tokenizer as load
    try:
        return load(path)
    except Exception as e:  # tokenizers/transformers raise many types; the message is what matters
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelDirError(f"cannot load a tokenizer from {role} model directory {path} ({first[:200]})") from None


def model_config(path: str, role: str = "target"):
    """The fields of config.json the caller needs (vocab_size, hidden_size, eos_token_id), read as JSON: loading
    it through transformers' AutoConfig would import torch into the caller's process."""
    from types import SimpleNamespace
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        return SimpleNamespace(vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
                               eos_token_id=cfg.get("eos_token_id"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelDirError(f"{role} model directory {path} has an unusable config.json ({e})") from None


def _tp_check(path: str, world: int) -> None:
    if world > 1:  # imports torch.distributed and transformers: only when ranks are asked for
        from transformers import AutoConfig

        from ..runner.tensor_parallel import check_model
        check_model(AutoConfig.from_pretrained(path, local_files_only=True), world)


def draft_feature_size(draft: str, dcfg) -> int | None:
    """The size of the target feature a feature-conditioned draft reads (None: an ordinary draft)."""
    from safetensors import safe_open

    from ..runner.model_files import FEATURE_FILE
    f = os.path.join(draft, FEATURE_FILE)
    if not os.path.exists(f):
        return None
    try:
        with safe_open(f, "numpy") as fh:
            rows, cols = fh.get_slice("weight").get_shape()
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line error
        raise ModelDirError(f"draft model directory {draft} has an unreadable {FEATURE_FILE} ({e})") from None
    if rows != dcfg.hidden_size or cols <= dcfg.hidden_size:
        raise ModelDirError(f"{f}: weight shape {[rows, cols]} does not fit hidden size {dcfg.hidden_size}")
    return cols - dcfg.hidden_size


def check_pair(target: str, draft: str, need_draft: bool = True, target_tp: int = 1, draft_tp: int = 1):
    """Check both directories (and that their shapes split over the tensor-parallel ranks) and load the target's
    tokenizer; returns (tokenizer, vocab_size, eos ids). A self-draft ("self:int4") is the target itself."""
    from ..config import self_scheme
    from ..runner.gguf import check_gguf, is_gguf, model_dir
    if self_scheme(draft):
        need_draft, draft_tp = False, 1  # nothing of its own to check; it runs on one rank (config refuses more)
    for role, path, needed in (("target", target, True), ("draft", draft, need_draft)):
        if needed and is_gguf(path):  # a GGUF file: its tokenizer and config come from its companion folder
            problem = check_gguf(path, role)
            if problem:
                raise ModelDirError(problem)
        elif needed:
            check_model_dir(path, role)
    target, draft = model_dir(target), model_dir(draft) if need_draft else draft
    tok = load_tokenizer(target, "target")
    tcfg = model_config(target, "target")
    _tp_check(target, target_tp)
    if need_draft:
        from ..runner.model_files import load_vocab_map
        dcfg = model_config(draft, "draft")
        _tp_check(draft, draft_tp)
        try:
            vmap = load_vocab_map(draft)  # a reduced-vocabulary draft names the vocabulary it maps into
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelDirError(f"draft model directory {draft} has an unusable vocabulary map ({e})") from None
        dvocab = vmap[1] if vmap else dcfg.vocab_size
        if tcfg.vocab_size != dvocab:
            raise ModelDirError(f"draft vocab {dvocab} ({draft}) != target vocab {tcfg.vocab_size} "
                                f"({target}): the pair must share a tokenizer")
        feature_size = draft_feature_size(draft, dcfg)
        if feature_size is not None:
            if feature_size != tcfg.hidden_size:
                raise ModelDirError(f"draft {draft} reads target features of size {feature_size}, but the target's "
                                    f"hidden size is {tcfg.hidden_size}: it was trained for another target")
            if target_tp > 1 or draft_tp > 1:
                raise ModelDirError(f"draft {draft} is feature-conditioned (EAGLE-style); that is not supported with "
                                    "tensor-parallel workers yet")
    return tok, tcfg.vocab_size, eos_ids(tcfg, tok)


def eos_ids(model_config, tokenizer) -> list[int]:
    eos = getattr(model_config, "eos_token_id", None)
    ids = list(eos) if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))
