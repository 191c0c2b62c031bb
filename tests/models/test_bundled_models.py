"""Sanity checks for the bundled tiny draft/target pair (minedraft/models/).

The models are produced by scripts/train/tiny_pair.py; these tests make sure the
shipped files load offline, share a tokenizer, and are actually useful as a
speculative-decoding pair (the draft agrees with the target a good fraction
of the time, and the target learned something).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parents[2] / "minedraft" / "models"
TARGET_DIR = MODELS / "tiny-target"
DRAFT_DIR = MODELS / "tiny-draft"
REPORT = MODELS / "training_report.json"

pytestmark = pytest.mark.skipif(
    not (TARGET_DIR / "model.safetensors").exists() or not (DRAFT_DIR / "model.safetensors").exists(),
    reason="bundled models not present (run scripts/train/tiny_pair.py)",
)


@pytest.fixture(scope="module")
def bundle():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok_t = AutoTokenizer.from_pretrained(TARGET_DIR)
    tok_d = AutoTokenizer.from_pretrained(DRAFT_DIR)
    target = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT_DIR, dtype=torch.float32).eval()
    return tok_t, tok_d, target, draft


def heldout_windows(tok, n_windows=4, length=128):
    """Token windows from the pages the training script held out."""
    from pydoc_data.topics import topics

    pages = json.loads(REPORT.read_text())["data"]["eval_pages"]
    ids = []
    for p in pages:
        ids += tok.encode(topics[p], add_special_tokens=False) + [tok.eos_token_id]
    assert len(ids) >= n_windows * length
    stride = (len(ids) - length) // max(n_windows - 1, 1)
    return torch.tensor([ids[i * stride : i * stride + length] for i in range(n_windows)])


def test_tokenizers_identical(bundle):
    tok_t, tok_d, target, draft = bundle
    assert tok_t.get_vocab() == tok_d.get_vocab()
    assert len(tok_t) == target.config.vocab_size == draft.config.vocab_size == 2048
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (TARGET_DIR / f).read_bytes() == (DRAFT_DIR / f).read_bytes()
    assert tok_t.eos_token == "<|endoftext|>"
    assert tok_t.eos_token_id == target.config.eos_token_id == draft.config.eos_token_id
    assert tok_t.pad_token_id is not None


def test_tokenizer_roundtrip_non_ascii(bundle):
    tok = bundle[0]
    for text in ["naïve café — 東京", "def f(x):\n    return x ** 2  # ✓\n", "  leading spaces and\ttabs"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text


def test_configs(bundle):
    _, _, target, draft = bundle
    assert target.config.model_type == draft.config.model_type == "llama"
    assert target.config.num_hidden_layers == 6 and target.config.hidden_size == 256
    assert draft.config.num_hidden_layers == 1 and draft.config.hidden_size == 128
    assert next(target.parameters()).dtype == torch.float32


def test_draft_agrees_with_target(bundle):
    tok, _, target, draft = bundle
    x = heldout_windows(tok)
    with torch.no_grad():
        t_arg = target(x).logits.argmax(-1)
        d_arg = draft(x).logits.argmax(-1)
    agreement = (t_arg == d_arg).float().mean().item()
    assert agreement >= 0.4, f"teacher-forced draft/target argmax agreement only {agreement:.3f}"


def test_target_learned_something(bundle):
    tok, _, target, _ = bundle
    x = heldout_windows(tok)
    with torch.no_grad():
        logits = target(x).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1)).item()
    assert loss < 0.6 * math.log(2048), f"held-out loss {loss:.3f} vs uniform {math.log(2048):.3f}"


def test_generate_runs(bundle):
    tok, _, target, draft = bundle
    enc = tok("The return statement", return_tensors="pt", add_special_tokens=False)
    for model in (target, draft):
        out = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        assert out.shape == (1, enc["input_ids"].shape[1] + 8)
        assert isinstance(tok.decode(out[0]), str)
