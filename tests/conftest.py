"""Shared fixtures: tiny random models built on the fly, so the tests need neither a hub nor the bundled pair.

`tiny_pair` is a byte-level BPE tokenizer, a random 2-layer Llama target and a draft that is the target plus
gaussian weight noise. The noise is tuned so the draft's greedy choice matches the target's only part of the
time (roughly 60% teacher-forced): speculative decoding then both accepts and rejects drafts, and a test that
only ever took one path would notice (see test_local_engine.test_tiny_pair_agrees_partially).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engine workers too (one torch thread each, whatever cores they get): see the comment below
os.environ.setdefault("MINEDRAFT_WORKER_THREADS", "1")

import torch  # noqa: E402

# The models here are tiny: intra-op threads only add synchronisation overhead (10-50x on a small shared box).
torch.set_num_threads(int(os.environ.get("MINEDRAFT_TEST_THREADS", "1")))

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO_ROOT / "minedraft" / "models"

VOCAB = 300
INIT_RANGE = 0.2      # peakier than HF's default 0.02, so greedy argmaxes have clear margins
DRAFT_NOISE = 0.01    # absolute std of the noise added to every target weight to make the draft
EOS_BOOST = 1.5       # raises the eos logit a little, so greedy generations sometimes end on eos


@dataclass(frozen=True)
class TinyPair:
    root: Path
    target: str          # Llama target dir (model + tokenizer)
    draft: str           # noisy copy of the target (model + tokenizer)
    qwen2: str           # Qwen2 target (q/k/v projections with bias), same tokenizer
    eos_token_id: int
    vocab_size: int


def _train_tokenizer():
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(list(topics.values())[:50], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>")
    assert len(tok) == VOCAB and tok.eos_token_id == 0
    return tok


def _common(eos):
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                initializer_range=INIT_RANGE, eos_token_id=eos, bos_token_id=None, pad_token_id=eos,
                tie_word_embeddings=False)


def _boost_eos(model, tok, eos):
    """Add to eos's output row the mean direction of the final hidden states on some text."""
    from pydoc_data.topics import topics

    ids = torch.tensor([tok.encode(v)[:40] for v in list(topics.values())[60:80]])
    with torch.no_grad():
        mu = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size).mean(0)
        model.lm_head.weight[eos] += EOS_BOOST * mu / mu.norm() ** 2


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> TinyPair:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("tiny_pair")
    tok = _train_tokenizer()
    eos = tok.eos_token_id

    torch.manual_seed(1234)
    target = LlamaForCausalLM(LlamaConfig(**_common(eos))).eval()
    _boost_eos(target, tok, eos)
    draft = LlamaForCausalLM(LlamaConfig(**_common(eos))).eval()
    draft.load_state_dict(target.state_dict())
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * DRAFT_NOISE)

    qwen = Qwen2ForCausalLM(Qwen2Config(**_common(eos), use_sliding_window=False)).eval()
    with torch.no_grad():  # HF initialises biases to zero; make them matter
        for layer in qwen.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                assert proj.bias is not None
                proj.bias.normal_(0, 0.5)

    dirs = {}
    for name, model in (("target", target), ("draft", draft), ("qwen2", qwen)):
        d = root / name
        model.save_pretrained(d)
        tok.save_pretrained(d)
        dirs[name] = str(d)
    return TinyPair(root, dirs["target"], dirs["draft"], dirs["qwen2"], eos, VOCAB)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair.target, local_files_only=True)


@pytest.fixture(scope="session")
def bundled_pair():
    """(target_dir, draft_dir) of the models shipped under minedraft/models, or skip when they are absent."""
    target, draft = MODELS_DIR / "tiny-target", MODELS_DIR / "tiny-draft"
    for d in (target, draft):
        if not (d / "config.json").exists() or not any(d.glob("*.safetensors")):
            pytest.skip(f"bundled model {d} not present (run scripts/train/tiny_pair.py)")
    return str(target), str(draft)


def engine_config(pair, target: str | None = None, **kw):
    """An EngineConfig on a test pair: the pair's target (or `target`) and draft, then each test module's own
    defaults and the test's overrides (modules bind theirs with functools.partial; later keywords win). Fixed k
    unless a test asks for dynamic speculation (the engine's default): these tests drive the drafts themselves."""
    from minedraft.config import EngineConfig
    return EngineConfig(**{"target": target or pair.target, "draft": pair.draft, "adaptive_k": False, **kw})
