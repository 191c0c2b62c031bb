"""The KV cache and the request limits sized from the machine and the model (minedraft/kv_budget.py), when the
configuration leaves them unset; and every limit's error names the setting and the flag behind it."""

from __future__ import annotations

import json

import pytest

from minedraft import kv_budget
from minedraft.config import EngineConfig
from minedraft.engine.request_state import make_request
from minedraft.errors import InvalidRequestError
from minedraft.sampling_params import SamplingParams

GiB = 1 << 30
# SmolLM2-135M's shapes: 30 layers x 3 KV heads x 64 x (K, V) x 4 bytes = 46,080 bytes per position
SMOL = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_size": 576, "head_dim": 64, "max_position_embeddings": 8192}


def _model(tmp_path, name="m", weights=1 << 20, **over):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**SMOL, **over}))
    (d / "model.safetensors").write_bytes(b"\0" * weights)
    return str(d)


@pytest.fixture
def memory(monkeypatch):
    def set_available(n):
        monkeypatch.setattr(kv_budget, "available_memory", lambda: n)
    set_available(20 * GiB)
    return set_available


def test_bytes_per_position_from_config():
    assert kv_budget.kv_bytes_per_token(SMOL, "float32") == 46080
    assert kv_budget.kv_bytes_per_token({**SMOL, "head_dim": None}, "bfloat16") == 46080 // 2  # 576 / 9 = 64


def test_cache_is_a_fraction_of_available_memory_for_both_workers(tmp_path, memory):
    t = _model(tmp_path)
    cfg = EngineConfig(target=t, draft="self:int4")  # a self-draft: the drafter's cache has the target's shape
    want = int(0.02 * 20 * GiB) // (2 * 46080) // 16 * 16
    assert cfg.kv_cache_tokens == want
    assert cfg.sizing.kv_bytes == want * 2 * 46080 <= 0.02 * 20 * GiB
    # the suffix drafter runs no model: the whole budget is the target's
    alone = EngineConfig(target=t, draft="suffix")
    assert alone.kv_cache_tokens == int(0.02 * 20 * GiB) // 46080 // 16 * 16
    half = EngineConfig(target=t, draft="self:int4", kv_cache_memory_fraction=0.01)
    assert abs(half.kv_cache_tokens - want / 2) <= 16


def test_limits_follow_the_context_and_an_881_token_prompt_fits(tmp_path, memory):
    memory(200 * GiB)  # plenty: the context bounds the request
    cfg = EngineConfig(target=_model(tmp_path), draft="self:int4", max_batch_size=4)
    assert cfg.max_tokens_limit == 1024
    assert cfg.max_prompt_tokens == 8192 - 1024 - cfg.k - 1 >= 881
    # the cache is capped by what max_batch_size requests of the longest kind use
    assert cfg.kv_cache_tokens == cfg.max_batch_size * 8192
    small = EngineConfig(target=_model(tmp_path, "small", max_position_embeddings=1024), draft="suffix")
    assert (small.max_tokens_limit, small.max_prompt_tokens) == (512, 1024 - 512 - small.k - 1)


def test_a_small_budget_bounds_the_longest_request(tmp_path, memory):
    memory(2 * GiB)  # 0.02 of it holds 444 positions per worker (x2 workers), less than the context
    cfg = EngineConfig(target=_model(tmp_path), draft="self:int4")
    assert cfg.kv_cache_tokens < 8192
    assert cfg.max_prompt_tokens + cfg.max_tokens_limit + cfg.k + 1 <= cfg.kv_cache_tokens


def test_explicit_values_are_kept(tmp_path, memory):
    cfg = EngineConfig(target=_model(tmp_path), draft="suffix", kv_cache_tokens=4096, max_prompt_tokens=100,
                       max_tokens_limit=50)
    assert (cfg.kv_cache_tokens, cfg.max_prompt_tokens, cfg.max_tokens_limit) == (4096, 100, 50)
    assert cfg.sizing is None
    given_kv = EngineConfig(target=_model(tmp_path, "b"), draft="suffix", kv_cache_tokens=2048)
    assert given_kv.max_prompt_tokens + given_kv.max_tokens_limit + given_kv.k + 1 <= 2048


def test_model_that_does_not_fit_is_a_clear_error(tmp_path, memory):
    memory(10 << 20)
    with pytest.raises(ValueError, match=r"weights alone .* do not fit in the .* GiB of memory available"):
        EngineConfig(target=_model(tmp_path, weights=20 << 20), draft="suffix")
    memory(1 << 20)  # weights fit, the cache cannot hold one request
    with pytest.raises(ValueError, match="kv-cache-memory-fraction"):
        EngineConfig(target=_model(tmp_path, "c", weights=1), draft="suffix")
    with pytest.raises(ValueError, match="kv_cache_memory_fraction must be a number in"):
        EngineConfig(target=_model(tmp_path, "d"), draft="suffix", kv_cache_memory_fraction=1.5)


def test_limit_errors_name_the_setting_and_the_flag(tmp_path, tiny_pair, tiny_tokenizer):
    cfg = EngineConfig(target=tiny_pair.target, draft=tiny_pair.draft, max_prompt_tokens=4, max_tokens_limit=8,
                       kv_cache_tokens=1024)
    long = "the class statement defines a class " * 3
    with pytest.raises(InvalidRequestError, match="max_prompt_tokens.*--max-prompt-tokens") as e:
        make_request("r", long, SamplingParams(max_tokens=4), tiny_tokenizer, cfg, tiny_pair.vocab_size)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="max_prompt_tokens.*--max-prompt-tokens"):
        make_request("r", "x" * 100, SamplingParams(max_tokens=4), tiny_tokenizer, cfg, tiny_pair.vocab_size)
    with pytest.raises(InvalidRequestError, match="max_tokens_limit.*--max-tokens-limit") as e:
        make_request("r", "the", SamplingParams(max_tokens=9), tiny_tokenizer, cfg, tiny_pair.vocab_size)
    assert e.value.param == "max_tokens"
