"""Prefix caching's block accounting (BlockManager) together with a worker cache (PagedKVCache) using its tables.

The fuzz test drives both with interleaved admits (sharing prefixes), steps with drafts and their rollback, a
lagging draft-like cache that feeds late, aborts, finishes and evictions under memory pressure, and checks after
every operation that each live sequence still reads exactly its own tokens at every position it holds (so no
shared block was ever changed under it), that refcounts match the tables, and at the end that nothing leaked.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minedraft.cache.paged_kv import PagedKVCache
from minedraft.cache.blocks import BlockManager

BS = 4


def worker_cache(num_blocks: int) -> PagedKVCache:
    return PagedKVCache(1, 1, 1, num_blocks * BS, BS)


def feed(cache: PagedKVCache, sid, toks: list[int]) -> None:
    """What a forward does to the cache: write each new token's 'KV' (here the token id) past the length."""
    n = cache.length(sid)
    slots = cache.slots(sid, n, n + len(toks))
    cache.k[0][slots, 0, 0] = torch.tensor(toks, dtype=torch.float32)
    cache.extend(sid, len(toks))


def held(cache: PagedKVCache, sid) -> list[int]:
    n = cache.length(sid)
    return [int(x) for x in cache.k[0][cache.slots(sid, 0, n), 0, 0]]


# -- unit tests -------------------------------------------------------------------------------------------------

def test_second_request_shares_full_prompt_blocks_and_computes_only_the_rest():
    bm, wc = BlockManager(16, BS), worker_cache(16)
    prompt = list(range(1, 11))                       # 10 tokens: 2 full blocks below the last token
    table, cached = bm.admit("a", prompt, 14)
    assert cached == 0 and wc.allocate("a", 14, table, prompt, cached) == 0
    feed(wc, "a", prompt)
    bm.mark_ready("a")
    wc.commit("a", prompt, 9)
    t2, cached2 = bm.admit("b", prompt + [99], 15)
    assert cached2 == 8 and t2[:2] == table[:2] and t2[2] != table[2]  # the partial block is its own
    assert wc.allocate("b", 15, t2, prompt + [99], cached2) == 8
    assert bm.used_blocks == 4 + 4 - 2                # shared blocks counted once
    feed(wc, "b", prompt[8:] + [99])
    assert held(wc, "b") == prompt + [99] and held(wc, "a") == prompt
    bm.check()


@pytest.mark.parametrize("plen, shared", [(3, 0), (4, 0), (5, 4), (8, 4), (9, 8)])
def test_only_blocks_below_the_last_prompt_token_are_shared(plen, shared):
    """Shorter than a block, exactly k blocks (the last token is always fed), k blocks + 1."""
    bm = BlockManager(16, BS)
    prompt = list(range(plen))
    bm.admit("a", prompt, plen + 4)
    bm.mark_ready("a")
    assert bm.admit("b", prompt, plen + 4)[1] == shared


def test_a_pending_prefix_makes_the_next_request_wait_and_an_unconfirmed_one_is_forgotten():
    bm = BlockManager(16, BS)
    p = list(range(9))
    bm.admit("a", p, 12)
    assert bm.cost(p, 12) == (3, True)
    bm.free("a")                                      # aborted before its prefill ran
    assert bm.match(p) == ([], False) and bm.num_available == 16
    bm.check()


def test_freed_blocks_stay_cached_and_are_evicted_least_recently_used_first():
    bm = BlockManager(6, BS)
    pa, pb = [1] * 9, [2] * 9
    for sid, p in (("a", pa), ("b", pb)):
        bm.admit(sid, p, 9)
        bm.mark_ready(sid)
        bm.free(sid)
    assert bm.num_cached == 4 and bm.num_available == 6
    assert bm.admit("a2", pa, 9)[1] == 8              # touching a's prefix makes b's the older one
    bm.free("a2")
    bm.admit("c", [3] * 9, 12)                        # 3 fresh: 2 free, then 1 evicted: b's tail first
    assert bm.stats.evictions == 1 and bm.match(pa)[0] and len(bm.match(pb)[0]) == 1
    bm.check()


def test_commit_registers_the_reply_so_a_resent_conversation_shares_it():
    bm = BlockManager(16, BS)
    prompt, reply = [5] * 6, [7] * 7
    bm.admit("a", prompt, 16)
    bm.mark_ready("a")
    bm.commit("a", prompt + reply, len(prompt + reply) - 1)
    bm.free("a")
    assert bm.admit("b", prompt + reply + [8, 9], 20)[1] == 12


def test_rollback_into_a_shared_or_committed_block_raises():
    wc = worker_cache(8)
    wc.allocate("a", 12)
    feed(wc, "a", list(range(10)))
    wc.commit("a", list(range(10)), 9)
    wc.truncate("a", 9)
    with pytest.raises(ValueError, match="committed or shared"):
        wc.truncate("a", 7)


def test_no_caching_shares_nothing():
    bm = BlockManager(8, BS, caching=False)
    bm.admit("a", [1] * 9, 9)
    bm.mark_ready("a")
    assert bm.admit("b", [1] * 9, 9)[1] == 0 and bm.stats.queries == 0


# -- fuzz ---------------------------------------------------------------------------------------------------------

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [3] * 12, [4, 4]]


class CacheMachine(RuleBasedStateMachine):
    """The scheduler's BlockManager and two worker caches on its tables: a verifier-like one fed every step and a
    draft-like one that may lag (feeds only sometimes), with drafts written then rolled back."""

    def __init__(self):
        super().__init__()
        self.nb = 10
        self.bm = BlockManager(self.nb, BS)
        self.target, self.draft = worker_cache(self.nb), worker_cache(self.nb)
        self.seqs: dict[int, dict] = {}
        self.next_id = 0

    @rule(p=st.sampled_from(range(len(PREFIXES))), extra=st.lists(st.integers(10, 12), max_size=5),
          max_new=st.integers(1, 8))
    def admit(self, p, extra, max_new):
        prompt = PREFIXES[p] + extra
        reserve = len(prompt) + max_new + 3
        need, pending = self.bm.cost(prompt, reserve)
        avail_free = len(self.bm._free)
        if pending or need > self.bm.num_available:
            with pytest.raises(MemoryError) if need > self.bm.num_available else _nothing():
                self._admit(prompt, reserve, max_new, avail_free, need)
            return
        self._admit(prompt, reserve, max_new, avail_free, need)

    def _admit(self, prompt, reserve, max_new, avail_free, need):
        ev = self.bm.stats.evictions
        table, cached = self.bm.admit(self.next_id, prompt, reserve)
        fresh = self.bm.blocks_for(reserve) - cached // BS
        assert self.bm.stats.evictions - ev == max(0, fresh - avail_free)  # evicts only when nothing is free
        sid = self.next_id
        self.next_id += 1
        starts = [c.allocate(sid, reserve, table, prompt, cached) for c in (self.target, self.draft)]
        assert all(s <= cached and s % BS == 0 for s in starts)
        self.seqs[sid] = {"tokens": list(prompt), "left": max_new, "steps": 0}

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), k=st.integers(0, 3), lag=st.booleans())
    def step(self, data, k, lag):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[sid]
        toks = s["tokens"]
        drafts = data.draw(st.lists(st.integers(20, 30), min_size=k, max_size=k))
        n_acc = data.draw(st.integers(0, k))
        for cache, fed in ((self.target, True), (self.draft, not lag)):
            if fed:  # feed the unfed tail and the drafts, then roll the rejected ones back
                L = cache.length(sid)
                feed(cache, sid, toks[L:] + drafts)
                cache.truncate(sid, len(toks) + n_acc if cache is self.target else
                               min(cache.length(sid), len(toks) + n_acc))
        new = drafts[:n_acc] + [data.draw(st.integers(10, 12))]
        toks += new[:s["left"]]
        s["left"] -= len(new[:s["left"]])
        self.target.truncate(sid, min(self.target.length(sid), len(toks) - 1))
        self.target.commit(sid, toks, len(toks) - 1)
        self.draft.commit(sid, toks, len(toks) - 1)
        if s["steps"] == 0:
            self.bm.mark_ready(sid)
        s["steps"] += 1
        if s["left"] == 0:
            self._release(sid)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def abort(self, data):
        self._release(data.draw(st.sampled_from(sorted(self.seqs))))

    def _release(self, sid):
        s = self.seqs.pop(sid)
        if s["steps"]:
            self.bm.commit(sid, s["tokens"], len(s["tokens"]) - 1)
        for c in (self.target, self.draft):
            c.free(sid)
        self.bm.free(sid)

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        self.bm.check()
        for sid, s in self.seqs.items():
            for c in (self.target, self.draft):
                got = held(c, sid)
                assert got[:len(s["tokens"])] == s["tokens"][:len(got)], f"sequence {sid} reads {got}"

    def teardown(self):
        for sid in list(self.seqs):
            self._release(sid)
        self.bm.check()
        assert self.bm.num_available == self.nb and not any(self.bm.ref)
        assert self.target.num_seqs == self.draft.num_seqs == 0


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def test_cli_flag_turns_prefix_caching_off():
    from minedraft.cli import main as cli
    on = cli._engine_kw(cli.build_parser().parse_args(["generate", "x"]))
    off = cli._engine_kw(cli.build_parser().parse_args(["serve", "--no-prefix-caching"]))
    assert on["prefix_caching"] is True and off["prefix_caching"] is False


def test_admission_passes_over_a_request_waiting_for_a_pending_prefix_but_not_one_waiting_for_memory():
    """The scheduler's and LocalEngine's admission: a request whose prefix another request is still computing
    does not hold back a distinct request behind it; one that does not fit stops the queue (first come, first
    served for memory)."""
    from collections import deque
    from types import SimpleNamespace

    from minedraft.cache.admission import Admission
    from minedraft.ipc.messages import NewRequest
    from minedraft.sampling_params import SamplingParams
    cfg = SimpleNamespace(kv_cache_tokens=64 * 16, block_size=16, prefix_caching=True, target="t", draft="d",
                          dtype="float32", speculative=True)
    adm = Admission(cfg, max_draft=3)

    def state(rid, prompt, max_tokens=8):
        return SimpleNamespace(req=NewRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), 0))
    shared = list(range(100, 148))  # three full blocks
    a, b, c = state(0, shared + [1]), state(1, shared + [2]), state(2, list(range(300, 340)))
    assert adm.admit_from(deque([a]), 8) == [a] and a.req.cached == 0
    q = deque([b, c])
    assert adm.admit_from(q, 8) == [c] and list(q) == [b]   # b waits for a's prefix; c, behind it, starts
    adm.on_result(0, [5])                                    # a's prefill ran: its prompt blocks are ready
    assert adm.admit_from(q, 8) == [b] and b.req.cached == 48 and not q
    big, small = state(3, list(range(500, 532)), max_tokens=900), state(4, [7, 8, 9])
    assert adm.fits_ever(big.req) and adm.blocks.cost(big.req.prompt_ids, adm.reserve(big.req))[0] > adm.free_blocks
    q = deque([big, small])
    assert adm.admit_from(q, 8) == [] and list(q) == [big, small]  # big does not fit yet: small waits behind it
    assert adm.admit_from(deque([small]), 0) == []                  # no room in the batch
