"""Paged KV cache bookkeeping, and the ModelRunner's ragged forward against Hugging Face's own forward.

The key property: after feeding k draft tokens and rolling back to an accepted prefix, the next token's logits
are exactly those of a fresh prefill of the accepted prefix plus that token (stale cache entries never leak).
"""

from __future__ import annotations

import pytest
import torch

from minedraft.cache.paged_kv import PagedKVCache
from minedraft.cache.paged_kv import BlockAllocator
from minedraft.runner.model_runner import ModelRunner

ATOL = 1e-4


# -- BlockAllocator -------------------------------------------------------------------------------

def test_allocator_hands_out_distinct_blocks_until_empty():
    a = BlockAllocator(5)
    got = a.allocate(2) + a.allocate(3)
    assert sorted(got) == [0, 1, 2, 3, 4] and a.num_free == 0
    with pytest.raises(MemoryError):
        a.allocate(1)
    assert a.allocate(0) == []


def test_allocator_allocate_beyond_free_raises_and_changes_nothing():
    a = BlockAllocator(4)
    a.allocate(3)
    with pytest.raises(MemoryError):
        a.allocate(2)
    assert a.num_free == 1
    assert len(a.allocate(1)) == 1


def test_allocator_double_free_raises():
    a = BlockAllocator(4)
    blocks = a.allocate(2)
    a.free(blocks)
    assert a.num_free == 4
    with pytest.raises(ValueError, match="freed twice"):
        a.free(blocks[:1])
    assert a.num_free == 4


def test_allocator_free_of_never_allocated_raises():
    a = BlockAllocator(4)
    a.allocate(1)
    with pytest.raises(ValueError):
        a.free([3])
    with pytest.raises(ValueError):
        a.free([17])


def test_allocator_reuses_freed_blocks():
    a = BlockAllocator(3)
    x = a.allocate(3)
    a.free([x[1]])
    assert a.allocate(1) == [x[1]]


def test_allocator_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockAllocator(0)


# -- PagedKVCache bookkeeping ---------------------------------------------------------------------

def small_cache(num_tokens=64, block_size=4):
    return PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_tokens=num_tokens, block_size=block_size)


def test_cache_allocate_reserves_whole_blocks():
    c = small_cache(64, 4)  # 16 blocks
    assert c.blocks_for(1) == 1 and c.blocks_for(4) == 1 and c.blocks_for(5) == 2
    c.allocate("a", 10)          # 3 blocks
    assert "a" in c and c.length("a") == 0 and c.used_blocks == 3 and c.num_seqs == 1
    assert c.can_allocate(52) and not c.can_allocate(53)
    assert c.fits_ever(64) and not c.fits_ever(65)
    with pytest.raises(ValueError):
        c.allocate("a", 1)       # already has cache
    with pytest.raises(MemoryError):
        c.allocate("b", 53)
    assert "b" not in c and c.used_blocks == 3  # a failed admission leaks nothing
    c.free("a")
    assert "a" not in c and c.used_blocks == 0
    c.free("a")                  # freeing twice at this level is harmless
    assert c.used_blocks == 0


def test_cache_slots_are_private_and_bounded_by_reservation():
    c = small_cache(64, 4)
    c.allocate(0, 6)             # 2 blocks -> capacity 8
    c.allocate(1, 9)             # 3 blocks -> capacity 12
    s0, s1 = c.slots(0, 0, 8), c.slots(1, 0, 12)
    assert len(set(s0.tolist())) == 8 and len(set(s1.tolist())) == 12
    assert not set(s0.tolist()) & set(s1.tolist())
    assert all(0 <= s < 64 for s in s0.tolist() + s1.tolist())
    torch.testing.assert_close(c.slots(1, 3, 7), s1[3:7])
    with pytest.raises(MemoryError):
        c.slots(0, 0, 9)


def test_cache_truncate_and_extend_bookkeeping():
    c = small_cache()
    c.allocate("s", 20)
    c.extend("s", 7)
    assert c.length("s") == 7
    c.truncate("s", 7)           # no-op truncate is allowed
    c.truncate("s", 3)
    assert c.length("s") == 3
    for bad in (4, -1):
        with pytest.raises(ValueError):
            c.truncate("s", bad)  # can only roll back, never forward or below zero
    c.extend("s", 5)
    assert c.length("s") == 8
    c.truncate("s", 0)
    assert c.length("s") == 0
    assert c.used_blocks == 5    # rollback never returns blocks: the reservation holds until free


def test_cache_num_blocks_from_tokens():
    assert small_cache(64, 16).num_blocks == 4
    assert small_cache(3, 16).num_blocks == 1


# -- ModelRunner against Hugging Face -------------------------------------------------------------

def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def fragment(cache: PagedKVCache, n: int = 6):
    """Allocate and free a few sequences so later block tables are non-contiguous and out of order."""
    for i in range(n):
        cache.allocate(("frag", i), cache.block_size)
    for i in range(0, n, 2):
        cache.free(("frag", i))


def rand_tokens(n, vocab, g):
    return torch.randint(1, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def llama_runner(tiny_pair):
    return ModelRunner.from_pretrained(tiny_pair.target, kv_cache_tokens=1024, block_size=4)


@pytest.fixture(scope="module")
def qwen2_runner(tiny_pair):
    return ModelRunner.from_pretrained(tiny_pair.qwen2, kv_cache_tokens=1024, block_size=4)


def free_all(runner):
    for sid in list(runner.cache._tables):
        runner.cache.free(sid)


def check_prefill_draft_rollback(runner, seed):
    """Prefill ragged prompts, feed k drafts, roll back to different accepted prefixes, feed a new token:
    each step's logits must match HF's forward over the same tokens, and a fresh prefill of the result."""
    free_all(runner)
    model, vocab, cache = runner.model, runner.vocab_size, runner.cache
    g = torch.Generator().manual_seed(seed)
    fragment(cache)
    lens, k, accepted = [3, 9, 17, 30], 4, [0, 2, 4, 1]
    prompts = [rand_tokens(n, vocab, g) for n in lens]
    sids = [("req", i) for i in range(len(prompts))]
    for sid in sids:
        cache.allocate(sid, 64)
    tables = [cache._tables[s] for s in sids]
    assert any(t != sorted(t) or t[-1] - t[0] != len(t) - 1 for t in tables), "block tables not fragmented"

    logits = runner.forward(sids, prompts, num_logits=3)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(logits[i], hf_logits(model, p)[-3:], atol=ATOL, rtol=0)
        assert cache.length(sids[i]) == len(p)

    drafts = [rand_tokens(k, vocab, g) for _ in prompts]
    logits = runner.forward(sids, drafts, num_logits=k)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(logits[i], hf_logits(model, p + drafts[i])[-k:], atol=ATOL, rtol=0)
        assert cache.length(sids[i]) == len(p) + k

    # roll back to the accepted prefix and feed a token that differs from the rejected draft
    seqs = []
    for i, p in enumerate(prompts):
        cache.truncate(sids[i], len(p) + accepted[i])
        nxt = (drafts[i][accepted[i]] + 1) % vocab if accepted[i] < k else 5
        seqs.append(p + drafts[i][: accepted[i]] + [nxt])
    logits = runner.forward(sids, [[s[-1]] for s in seqs], num_logits=1)

    fresh = ModelRunner(model, kv_cache_tokens=512, block_size=4)
    for i, s in enumerate(seqs):
        fresh.cache.allocate(i, len(s))
    fresh_logits = fresh.forward(list(range(len(seqs))), seqs, num_logits=1)
    for i, s in enumerate(seqs):
        ref = hf_logits(model, s)[-1]
        torch.testing.assert_close(logits[i, 0], ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[i, 0], fresh_logits[i, 0], atol=ATOL, rtol=0)
        assert cache.length(sids[i]) == len(s)

    # and decoding goes on correctly past the rolled-back region (overwriting the stale entries)
    more = [rand_tokens(n, vocab, g) for n in (1, 3, 2, 6)]
    logits = runner.forward(sids, more, num_logits=1)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(logits[i, 0], hf_logits(model, s + more[i])[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_llama_runner_rollback_matches_fresh_prefill_and_hf(llama_runner, seed):
    check_prefill_draft_rollback(llama_runner, seed)


def test_qwen2_runner_rollback_matches_hf(qwen2_runner):
    assert qwen2_runner.model.config.model_type == "qwen2"
    assert qwen2_runner.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    check_prefill_draft_rollback(qwen2_runner, 2)


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_runner_mixed_prefill_and_decode_batch(which, llama_runner, qwen2_runner):
    """A long prefill beside short decodes in one call (the runner splits them into padded groups)."""
    runner = llama_runner if which == "llama" else qwen2_runner
    free_all(runner)
    g = torch.Generator().manual_seed(3)
    cache, vocab = runner.cache, runner.vocab_size
    a, b, c = ("a",), ("b",), ("c",)
    for sid in (a, b, c):
        cache.allocate(sid, 128)
    pa, pb = rand_tokens(5, vocab, g), rand_tokens(11, vocab, g)
    runner.forward([a, b], [pa, pb], 1)
    pc = rand_tokens(70, vocab, g)
    feeds = [[7], pc, [8, 9]]
    logits = runner.forward([a, c, b], feeds, num_logits=1)
    for i, full in enumerate([pa + [7], pc, pb + [8, 9]]):
        torch.testing.assert_close(logits[i, 0], hf_logits(runner.model, full)[-1], atol=ATOL, rtol=0)


def test_runner_refuses_to_write_past_reservation(llama_runner):
    free_all(llama_runner)
    cache = llama_runner.cache
    cache.allocate("x", 8)        # 2 blocks of 4
    llama_runner.forward(["x"], [[1, 2, 3, 4, 5]], 1)
    with pytest.raises(MemoryError):
        llama_runner.forward(["x"], [[6, 7, 8, 9]], 1)
    assert cache.length("x") == 5  # the failed call did not advance the sequence
    logits = llama_runner.forward(["x"], [[6, 7, 8]], 1)
    torch.testing.assert_close(logits[0, 0], hf_logits(llama_runner.model, [1, 2, 3, 4, 5, 6, 7, 8])[-1],
                               atol=ATOL, rtol=0)


def test_runner_num_logits_validation(llama_runner):
    free_all(llama_runner)
    llama_runner.cache.allocate("y", 16)
    with pytest.raises(ValueError):
        llama_runner.forward(["y"], [[]], num_logits=1)
    # a row shorter than num_logits (ragged Tetris drafts) is right-aligned, led by copies of its first logits
    llama_runner.cache.allocate("z", 16)
    rows = []
    kernels = llama_runner.kernels
    if kernels is not None:  # the C kernels' head matmul: count the rows it gets
        plain = kernels.matmul

        def spy(x, w, *rest):
            if w is kernels.head:
                rows.append(x.shape[0])
            return plain(x, w, *rest)
        kernels.matmul = spy
        undo = lambda: delattr(kernels, "matmul")  # noqa: E731
    else:
        undo = llama_runner.lm_head.register_forward_hook(
            lambda m, args, out: rows.append(args[0].numel() // args[0].shape[-1])).remove
    try:
        out = llama_runner.forward(["y", "z"], [[1], [1, 2, 3]], num_logits=3)
    finally:
        undo()
    assert rows == [4]  # the LM head runs once per distinct token (1 + 3), the repeats are copies
    ref_z = hf_logits(llama_runner.model, [1, 2, 3])
    torch.testing.assert_close(out[1], ref_z, atol=ATOL, rtol=0)
    for j in range(3):
        torch.testing.assert_close(out[0, j], ref_z[0], atol=ATOL, rtol=0)
    assert llama_runner.forward([], [], 1).shape == (0, 1, llama_runner.vocab_size)
