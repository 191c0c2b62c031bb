"""scripts/gpu/check.py runs once on a lent GPU with no chance to debug there, so its CPU smoke mode runs here:
the forced-agreement models behave as the script's output says, and the whole script reaches its table."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu" / "check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_forced_agreement_is_what_it_claims(tmp_path):
    gc = _script()
    target, draft = gc.build_models(str(tmp_path), 0.7, "cpu", "tiny", torch.float32)
    t = AutoModelForCausalLM.from_pretrained(target).eval()
    d = AutoModelForCausalLM.from_pretrained(draft).eval()
    vocab = t.config.vocab_size
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(1)).view(8, -1)  # every token once
    with torch.no_grad():
        nt, nd = t(ids).logits.argmax(-1), d(ids).logits.argmax(-1)
    # the target's next token depends only on the current one (a fixed permutation), whatever the context
    chain = {}
    for x, y in zip(ids.flatten().tolist(), nt.flatten().tolist()):
        chain[x] = y
    assert sorted(chain.values()) == list(range(vocab))
    with torch.no_grad():
        again = t(ids.flip(1)).logits.argmax(-1)
    assert [chain[x] for x in ids.flip(1).flatten().tolist()] == again.flatten().tolist()
    agree = (nt == nd).float().mean().item()
    assert 0.65 < agree < 0.75, agree


def test_cpu_smoke_run_reaches_the_table(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu" / "check.py"), "--cpu-smoke", "--agree", "0.8",
                        "--batch", "8", "--k", "1", "--repeats", "1", "--max-tokens", "24"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "agreement forced by construction at 80%" in out
    assert "0 GPU(s)" in out
    assert "target_tp=2 on cpu, cpu: 8/8 greedy outputs identical to tp=1" in out  # permutation heads: wide margins
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines()
            if line.startswith(("autoregressive", "sequential", "minedraft"))}
    assert set(rows) == {"autoregressive B=8", "sequential k=1 B=8", "minedraft k=1 B=8"}
    for name in ("sequential k=1 B=8", "minedraft k=1 B=8"):
        accept = float(rows[name][-9])   # accept, then tok/step, ver/step, out/ver, Td, Tv, step, overlap, same
        assert 0.6 < accept < 0.97, (name, accept)
        assert rows[name][-1] == "1.00", name  # permutation heads leave wide margins: bf16 stays exact here
    assert "x sequential SD at the same k" in out
    assert (tmp_path / "gpu_timeline.png").stat().st_size > 10_000


def test_timeline_is_written_under_out_not_the_working_directory():
    gc = _script()
    assert gc.default_plot_path({"OUT": "/x"}) == "/x/gpu_timeline.png"
    assert gc.default_plot_path({}) == str(ROOT / "out" / "gpu_timeline.png")
    assert not (ROOT / "gpu_timeline.png").exists()  # the stray smoke-run output is gone from the repository
