"""GGUF model files: recognising them, the optional llama-cpp-python dependency, and the Hugging Face folder that
carries a GGUF model's tokenizer and config for the caller's process (which tokenizes, renders chat templates and
checks the pair; only the workers run the weights, through llama.cpp: runner/llama_cpp.py).

Which folder: the GGUF's own folder when it holds a tokenizer and config.json (what `minedraft models pull` makes:
the GGUF is kept inside the converted model's folder), else one written once under
$XDG_CACHE_HOME/minedraft/gguf/ from the GGUF's own metadata (transformers reads GGUF tokenizers and configs).

Supported quantizations: any GGUF llama.cpp loads for a Llama-family model; measured here: F32 (the float32 weights
of the pulled model), Q8_0 and Q4_1 (SmolLM2's own file). A GGUF runs on the CPU only.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..config import INSTALL_HINT, check_gguf, is_gguf  # noqa: F401 (recognising a GGUF is config's: it validates)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def llama_cpp_available() -> bool:
    """Whether llama_cpp imports (and so its shared library loads) here."""
    try:
        import_llama_cpp()
    except ImportError:
        return False
    return True


def import_llama_cpp():
    """The llama_cpp module (low-level API), its C logging silenced below errors; ImportError with the one line
    that says what to install when it is missing."""
    global _log_callback
    try:
        import llama_cpp
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    if _log_callback is None:  # llama.cpp's own errors only (ggml's levels: 3 warn, 4 error, 5 continues a line)
        import ctypes
        import sys

        last = [0]

        def log(level, text, _):
            last[0] = last[0] if level == 5 else level
            if last[0] == 4:
                sys.stderr.write(text.decode("utf-8", "replace"))
        _log_callback = llama_cpp.llama_log_callback(log)
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
    return llama_cpp


_log_callback = None  # kept alive: llama.cpp holds a pointer to it


def gguf_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "minedraft" / "gguf"


def companion_dir(path: str) -> str:
    """The Hugging Face folder with the tokenizer and config.json of GGUF model `path` (see the module docstring)."""
    folder = Path(path).resolve().parent
    if (folder / "config.json").exists() and any((folder / f).exists() for f in TOKENIZER_FILES):
        return str(folder)
    st = os.stat(path)
    key = hashlib.blake2b(f"{Path(path).resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode(), digest_size=8).hexdigest()
    out = gguf_cache_root() / f"{Path(path).stem}-{key}"
    if not (out / "config.json").exists():
        from transformers import AutoConfig, AutoTokenizer
        kw = dict(gguf_file=Path(path).name, local_files_only=True)
        tmp = out.with_name(out.name + ".part")
        AutoTokenizer.from_pretrained(folder, **kw).save_pretrained(tmp)
        cfg = AutoConfig.from_pretrained(folder, **kw)
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        cfg.save_pretrained(tmp)
        os.replace(tmp, out)
    return str(out)


RUNNERS = ("auto", "torch", "llama.cpp")


def target_for_runner(target: str, runner: str = "auto") -> str:
    """The model --runner asks for: 'llama.cpp' takes the .gguf file a model folder holds (`models pull` keeps
    the one it converted), 'torch' refuses a .gguf file, 'auto' takes what it is given. ValueError: one line."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if runner == "torch" and is_gguf(target):
        raise ValueError(f"--runner torch cannot run {target!r}, a GGUF file: use --runner llama.cpp or a model folder")
    if runner != "llama.cpp" or is_gguf(target):
        return target
    files = sorted(Path(target).glob("*.gguf")) if os.path.isdir(target) else []
    if len(files) != 1:
        raise ValueError(f"--runner llama.cpp needs one .gguf file in {target} (found {len(files)}): pass --target "
                         "FILE.gguf, or run `minedraft models pull NAME` again, which keeps the model's GGUF")
    return str(files[0])


def model_dir(path: str) -> str:
    """Where the tokenizer and config of model `path` are: the path itself for a folder, the companion for a GGUF."""
    return companion_dir(path) if is_gguf(path) else path
