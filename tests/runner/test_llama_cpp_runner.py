"""The llama.cpp runner (minedraft/runner/llama_cpp.py) on SmolLM2-135M's own Q4_1 GGUF.

Needs llama-cpp-python (pip install -e ".[gguf]", which compiles llama.cpp) and the pulled pair (`minedraft models
pull smollm2-135m` keeps the GGUF in the target folder); each test that needs them is skipped, with that reason,
where they are missing. The option and error-message tests at the bottom run everywhere.
"""

from __future__ import annotations

import pytest
import torch

from minedraft.config import EngineConfig
from minedraft.models import hub
from minedraft.runner.gguf import INSTALL_HINT, is_gguf, llama_cpp_available, target_for_runner

BLOCK = 16


@pytest.fixture(scope="module")
def gguf_path():
    if not llama_cpp_available():
        pytest.skip('llama-cpp-python is not installed (pip install -e ".[gguf]"; it compiles llama.cpp, ~25 min)')
    if not hub.is_pulled("smollm2-135m"):
        pytest.skip("the SmolLM2-135M pair is not pulled (run `minedraft models pull smollm2-135m`)")
    try:
        return target_for_runner(hub.resolve("smollm2-135m")[0], "llama.cpp")
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def runner(gguf_path):
    from minedraft.runner.llama_cpp import LlamaCppRunner
    return LlamaCppRunner(gguf_path, 4096, BLOCK, threads=1)


@pytest.fixture(scope="module")
def prompts(gguf_path):
    from transformers import AutoTokenizer

    from minedraft.runner.gguf import model_dir
    tok = AutoTokenizer.from_pretrained(model_dir(gguf_path), local_files_only=True)
    texts = ["What is a lighthouse?", "Copy this list exactly: apples, pears, plums, cherries, figs, dates.",
             "Give me two facts about owls."]
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for t in texts]


def _greedy(runner, sid, prompt, n):
    """Decode alone: the prompt in one call, then one token per call; the tokens and each step's logits."""
    runner.cache.allocate(sid, len(prompt) + n + 1)
    lg = runner.forward([sid], [prompt], 1)[0, 0]
    toks, rows = [], []
    for _ in range(n):
        rows.append(lg)
        toks.append(int(lg.argmax()))
        lg = runner.forward([sid], [[toks[-1]]], 1)[0, 0]
    runner.cache.free(sid)
    return toks, torch.stack(rows)


def test_interface_shapes_and_right_alignment(runner, prompts):
    p = prompts[0]
    runner.cache.allocate("a", len(p) + 8)
    runner.cache.allocate("b", len(p) + 8)
    full = runner.forward(["a"], [p], 3)  # [1, 3, V]: the last three prompt positions
    assert full.shape == (1, 3, runner.vocab_size) and full.dtype == torch.float32
    rows, index = runner.forward(["b"], [p[:-1]], 1, packed=True)
    assert rows.shape == (1, runner.vocab_size) and index.tolist() == [[0]]
    # a row with fewer new tokens than num_logits repeats its first token's logits at the front
    out = runner.forward(["b"], [[p[-1]]], 3)
    assert torch.equal(out[0, 0], out[0, 2]) and torch.equal(out[0, 1], out[0, 2])
    assert runner.cache.length("a") == runner.cache.length("b") == len(p)
    with pytest.raises(ValueError):
        runner.forward(["a"], [[]], 1)
    runner.cache.free("a")
    runner.cache.free("b")
    assert runner.cache.num_seqs == 0


def test_rollback_recomputes_the_same_logits(runner, prompts):
    """truncate (llama_memory_seq_rm) forgets rejected drafts: scoring the same tokens again gives the same logits
    bitwise, and other tokens at those positions do not see the rejected ones."""
    p = prompts[1]
    cache = runner.cache
    cache.allocate("r", len(p) + 16)
    runner.forward(["r"], [p], 1)
    first = runner.forward(["r"], [[11, 12, 13, 14]], 4)
    cache.truncate("r", len(p) + 1)
    again = runner.forward(["r"], [[12, 13, 14]], 3)
    assert torch.equal(first[0, 1:], again[0])
    cache.truncate("r", len(p))
    other = runner.forward(["r"], [[21, 22, 23, 24]], 4)
    cache.free("r")
    cache.allocate("fresh", len(p) + 16)
    runner.forward(["fresh"], [p], 1)
    fresh = runner.forward(["fresh"], [[21, 22, 23, 24]], 4)
    cache.free("fresh")
    assert torch.equal(other, fresh)


def test_verify_windows_and_batch_rows_match_decoding_alone(runner, prompts):
    """What the verifier relies on for greedy identity: a position's logits are bitwise those of llama.cpp decoding
    the sequence alone, one token per call, whether scored in a window of 1-6 tokens or beside other rows (Q4_1
    weights: llama.cpp's quantized dot products are per row; docs/BENCHMARKS.md "llama.cpp runner" for F32)."""
    n = 12
    alone = [_greedy(runner, f"alone{i}", p, n) for i, p in enumerate(prompts)]
    for w in (2, 6):
        ids = [f"w{w}-{i}" for i in range(len(prompts))]
        for sid, p in zip(ids, prompts):
            runner.cache.allocate(sid, len(p) + n + 1)
        first = runner.forward(ids, prompts, 1)
        for i, (toks, rows) in enumerate(alone):
            assert torch.equal(first[i, 0], rows[0])
        for start in range(0, n - 1, w):  # token j of the output predicts j + 1: feed all but the last
            feeds = [toks[start:min(start + w, n - 1)] for toks, _ in alone]
            got = runner.forward(ids, feeds, w)  # a short last window is right-aligned
            for i, (toks, rows) in enumerate(alone):
                want = rows[start + 1:start + 1 + len(feeds[i])]
                assert torch.equal(got[i, w - len(want):], want), (w, i, start)
        for sid in ids:
            runner.cache.free(sid)


def test_shared_prefix_is_copied_not_recomputed(runner, prompts):
    """allocate with a prefix another live sequence committed: llama_memory_seq_cp shares its cells, the length
    starts past them, and the continuation scores as when computed from scratch."""
    p = prompts[2] * 3  # several full blocks
    cache = runner.cache
    cache.allocate("src", len(p) + 4)
    runner.forward(["src"], [p], 1)
    cache.commit("src", p, len(p))
    shared = (len(p) - 1) // BLOCK * BLOCK
    start = cache.allocate("dst", len(p) + 4, prompt=p, cached=shared)
    # own allocator (no scheduler table) records no prefix for another sequence's blocks: nothing shared
    assert start == 0
    cache.free("dst")
    blocks = cache._tables["src"]
    start = cache.allocate("dst", len(p) + 4, blocks=list(blocks), prompt=p, cached=shared)
    assert start == shared and cache.frozen("dst") == shared
    lg = runner.forward(["dst"], [p[start:]], 1)
    cache.free("src")
    cache.free("dst")
    cache.allocate("ref", len(p) + 4)
    ref = runner.forward(["ref"], [p], 1)
    cache.free("ref")
    assert torch.allclose(lg, ref, atol=1e-3) and int(lg.argmax()) == int(ref.argmax())


def test_local_engine_speculative_equals_autoregressive(gguf_path):
    """Greedy output through the llama.cpp runner: suffix drafts (sequential SD) equal the target alone, token for
    token, on prompts whose answers copy from them (so drafts are accepted and rejected), one request at a time
    (with several in flight llama.cpp's cell placement can differ: docs/BENCHMARKS.md "llama.cpp runner")."""
    from minedraft.engine.local_engine import LocalEngine
    from minedraft.sampling_params import SamplingParams
    texts = ["Repeat exactly: the red fox, the red fox, the red fox jumps over the lazy dog.",
             "List the numbers 1, 2, 3, 4, 5, 6, 7, 8 and then list them again.", "What is a lighthouse?"]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    kw = dict(target=gguf_path, kv_cache_tokens=4096, max_prompt_tokens=256, max_tokens_limit=64, max_batch_size=1)
    alone = LocalEngine(EngineConfig(mode="autoregressive", **kw)).generate(texts, params)
    spec = LocalEngine(EngineConfig(draft="suffix", mode="sequential", adaptive_k=False, **kw))
    out = spec.generate(texts, params)
    assert [r.token_ids for r in out] == [r.token_ids for r in alone]
    assert sum(r.stats.draft_tokens for r in out) > 0


# -- everywhere: options and errors --------------------------------------------------------------------------
def test_runner_option_picks_the_folder_gguf(tmp_path):
    (tmp_path / "m.Q4_1.gguf").write_bytes(b"GGUF")
    assert target_for_runner(str(tmp_path), "llama.cpp") == str(tmp_path / "m.Q4_1.gguf")
    assert target_for_runner(str(tmp_path), "auto") == str(tmp_path)
    with pytest.raises(ValueError, match="--runner torch cannot run"):
        target_for_runner(str(tmp_path / "m.Q4_1.gguf"), "torch")
    with pytest.raises(ValueError, match="needs one .gguf file"):
        target_for_runner(str(tmp_path / "nothing"), "llama.cpp")
    assert is_gguf("x.GGUF") and not is_gguf(str(tmp_path))


def test_gguf_target_without_llama_cpp_fails_in_one_line(tmp_path, monkeypatch):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF" + bytes(16))
    import minedraft.config as c
    monkeypatch.setattr(c, "llama_cpp_installed", lambda: False)
    with pytest.raises(ValueError) as e:
        EngineConfig(target=str(f), draft="suffix")
    msg = str(e.value)
    assert "\n" not in msg and INSTALL_HINT in msg and '.[gguf]' in msg


def test_not_a_gguf_file_is_refused(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"not gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        EngineConfig(target=str(f), draft="suffix")
    with pytest.raises(ValueError, match="is not a file"):
        EngineConfig(target=str(tmp_path / "missing.gguf"), draft="suffix")
