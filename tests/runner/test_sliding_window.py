"""Per-layer attention types: configs that mix full and sliding-window layers decode exactly like
transformers' generate, with prompt + output longer than the window (so the window really cuts keys)."""

from __future__ import annotations

import pytest
import torch

from minedraft.engine.local_engine import LocalEngine
from minedraft.sampling_params import SamplingParams
from minedraft.runner.model_runner import layer_windows

WINDOW = 8
PROMPTS = [list(range(5, 25)), list(range(40, 46)), [7, 9, 11, 13, 200, 150, 3, 77, 81, 90, 12, 14]]
MAX_TOKENS = 24


def _common(eos, vocab, layers=3, tie=False):
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                eos_token_id=eos, bos_token_id=None, pad_token_id=eos, tie_word_embeddings=tie)


def _save(model, tok_dir, path):
    from transformers import AutoTokenizer
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tok_dir, local_files_only=True).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def windowed(tiny_pair, tmp_path_factory):
    """name -> (model dir, hf model) for windowed tiny models of several kinds."""
    from transformers import (MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    root = tmp_path_factory.mktemp("windowed")
    eos, vocab = tiny_pair.eos_token_id, tiny_pair.vocab_size
    torch.manual_seed(7)
    made = {
        # layer 0 full, layers 1-2 sliding: transformers' Qwen2 rule (layers >= max_window_layers slide)
        "qwen2_mixed": Qwen2ForCausalLM(Qwen2Config(**_common(eos, vocab), use_sliding_window=True,
                                                    sliding_window=WINDOW, max_window_layers=1)),
        # explicit layer_types, sliding first, tied embeddings
        "qwen2_types_tied": Qwen2ForCausalLM(Qwen2Config(
            **_common(eos, vocab, tie=True), use_sliding_window=True, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
        # Qwen3 (q/k norms), same rule as Qwen2: layers 2.. slide
        "qwen3_mixed": Qwen3ForCausalLM(Qwen3Config(**_common(eos, vocab), head_dim=16, use_sliding_window=True,
                                                    sliding_window=WINDOW, max_window_layers=2)),
        # Mistral: every layer slides
        "mistral": MistralForCausalLM(MistralConfig(**_common(eos, vocab), sliding_window=WINDOW)),
    }
    out = {}
    for name, m in made.items():
        m = m.eval()
        out[name] = (_save(m, tiny_pair.target, root / name), m)
    return out


def test_layer_windows_follow_transformers_rule(windowed):
    assert layer_windows(windowed["qwen2_mixed"][1].config) == [None, WINDOW, WINDOW]
    assert layer_windows(windowed["qwen2_types_tied"][1].config) == [WINDOW, None, WINDOW]
    assert layer_windows(windowed["qwen3_mixed"][1].config) == [None, None, WINDOW]
    assert layer_windows(windowed["mistral"][1].config) == [WINDOW] * 3


def _hf_generate(model, ids):
    """MAX_TOKENS greedy tokens from transformers' generate that never stops on eos (min_new_tokens would instead
    mask eos out of the argmax, which ignore_eos does not): the stop id is one no token has."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=model.config.vocab_size, pad_token_id=0)
    assert out.shape[1] == len(ids) + MAX_TOKENS
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", ["qwen2_mixed", "qwen2_types_tied", "qwen3_mixed", "mistral"])
def test_windowed_models_decode_like_transformers(name, windowed):
    path, hf = windowed[name]
    refs = [_hf_generate(hf, p) for p in PROMPTS]
    # the window must matter for this test to mean anything: full attention everywhere gives other tokens
    cfg = hf.config
    full = type(hf)(type(cfg)(**{**cfg.to_dict(), "sliding_window": None, "layer_types": None,
                                 "use_sliding_window": False})).eval()
    full.load_state_dict(hf.state_dict())
    assert any(_hf_generate(full, p) != r for p, r in zip(PROMPTS, refs))
    kw = dict(target=path, draft=path, max_prompt_tokens=64, max_tokens_limit=64, kv_cache_tokens=4096)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    # a batch (rows of different lengths, so padding and per-row windows meet) and sequential SD with k=3
    # (several new tokens per row in one forward, each with its own window)
    for mode in ("autoregressive", "sequential"):
        res = LocalEngine(mode=mode, k=3, **kw).generate(PROMPTS, params)
        assert [r.token_ids for r in res] == refs, mode
