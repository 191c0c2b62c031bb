"""The drafter's model for a draft option: a model folder, a GGUF file, or a self-draft built from the target's
folder; and what a worker's model takes (reported in status)."""

from __future__ import annotations

from ..config import self_scheme
from .self_draft import load_self_draft, weight_bytes


def load_draft(draft: str, target: str, kv_cache_tokens: int, block_size: int = 16, device="cpu",
               dtype="float32"):
    """The drafter's runner for the draft option: a model folder, a GGUF file, or a self-draft built from the
    target's folder (of a GGUF target: the float32 weights of the folder it sits in, as `models pull` leaves it)."""
    from ..runner.gguf import is_gguf, model_dir
    if is_gguf(draft):  # a GGUF file (target or draft) runs through llama.cpp, on this process's cores
        from ..runner.llama_cpp import LlamaCppRunner
        return LlamaCppRunner(draft, kv_cache_tokens, block_size)
    from ..runner.model_runner import ModelRunner  # torch and transformers: on first use
    scheme = self_scheme(draft)
    if scheme is not None:
        return load_self_draft(model_dir(target), scheme, kv_cache_tokens, block_size, device)
    return ModelRunner.from_pretrained(draft, kv_cache_tokens, block_size, device, dtype)


def model_info(runner) -> dict:
    """What a worker's model takes: {"weight_bytes": n} (+ scheme and load_s for a self-draft)."""
    info = getattr(runner, "draft_info", None)
    if info is None:
        model = getattr(runner, "model", None)
        kernels = getattr(runner, "kernels", None)  # the packed copy, when the modules' own were freed
        info = {"weight_bytes": weight_bytes(model) + (kernels.nbytes if kernels is not None else 0)} \
            if model is not None else {}
    return dict(info)
