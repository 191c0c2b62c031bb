"""What the `minedraft` subcommands share: defaults, argument types, engine settings from parsed options,
error printing, and the environment that keeps libraries quiet. Light: no torch, no zmq at import."""

from __future__ import annotations

import argparse
import os
import re
import sys

from ..config import DEFAULT_DRAFT, EngineConfig

PROG = "minedraft"
ZMQ_DEFAULT_BIND = "tcp://127.0.0.1:5555"
_ENGINE_DEFAULTS = EngineConfig.__dataclass_fields__


def _default(name):
    return _ENGINE_DEFAULTS[name].default


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every option's default (unless its help already says it), keeps the descriptions' line breaks."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._AppendAction)) or action.default is None:
            return text + (" (default: off)" if isinstance(action, argparse._StoreTrueAction) else
                           " (default: none)")
        return super()._get_help_string(action)


def _run_async(coro, use_uvloop: bool = True):
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(coro)
    import asyncio
    return asyncio.run(coro)


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s}")
    return v


def _fraction(s: str) -> float:
    v = _positive_float(s)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {s}")
    return v


def _cores(s: str) -> list[int]:
    from ..cores import parse_cores
    try:
        return parse_cores(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _engine_kw(a) -> dict:
    target, draft = (a.target, a.draft if a.draft is not None else DEFAULT_DRAFT)
    if a.model:
        from ..config import SUFFIX, parse_draft
        from ..models.hub import resolve_model
        suffix, named = parse_draft(a.draft) if a.draft is not None else (False, None)
        if suffix:  # --draft suffix: no model; suffix+model (the pair's default draft) or suffix+DIR: the hybrid
            target, model = resolve_model(a.model, None if named in (None, "model") else named, model=True)
            draft = SUFFIX if named is None else f"{SUFFIX}+{model}"
        else:
            target, draft = resolve_model(a.model, a.draft)
    from ..runner.gguf import target_for_runner
    target = target_for_runner(target, getattr(a, "runner", "auto"))  # a ValueError is one line, as the config's
    return dict(target=target, draft=draft, mode=a.mode, k=a.k, adaptive_k=a.adaptive_k, tetris=a.tetris,
                hybrid_threshold=getattr(a, "hybrid_threshold", 1.0),
                tetris_capacity=a.tetris_capacity, tetris_extra=a.tetris_extra,
                max_prompt_tokens=a.max_prompt_tokens, dtype=a.dtype, target_device=a.target_device,
                draft_device=a.draft_device, draft_cores=a.draft_cores, target_cores=a.target_cores,
                target_tp=a.target_tp, draft_tp=a.draft_tp, prefix_caching=a.prefix_caching)


def _fail(msg: str, code: int = 2) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return code


# option a user typed, by the field name a validation message uses
_OPTION = {name: "--" + name.replace("_", "-") for name in (
    "k", "max_prompt_tokens", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos",
    "target", "draft", "mode", "dtype", "target_device", "draft_device", "max_tokens_limit", "max_batch_size",
    "kv_cache_tokens", "max_queue", "kv_cache_memory_fraction")}


def _name_options(msg: str) -> str:
    """'invalid EngineConfig: k must be ...' -> '--k must be ...': errors name what was typed, not our fields."""
    for prefix in ("invalid EngineConfig: ", "invalid SamplingParams: "):
        msg = msg.replace(prefix, "")
    m = re.match(r"(\w+)( model path)? ", msg)
    if m and m.group(1) in _OPTION:
        msg = _OPTION[m.group(1)] + msg[m.end(1):]
    return msg


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
