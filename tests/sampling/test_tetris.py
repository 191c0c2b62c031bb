"""Tetris draft selection: what it keeps, that the output stays exactly the target's (greedy identity,
chi-square of the sampled law, a wrong ranking rejected), that rows really get different draft counts, and
that a seeded request's output does not depend on what shares its batch."""

from __future__ import annotations

import functools

import asyncio
import random

import pytest
import torch

from minedraft.sampling import tetris
from minedraft.sampling.batch_sampling import RowParams, sample_draft_step, verify_batch
from minedraft.engine.engine import Engine
from minedraft.engine.local_engine import LocalEngine
from minedraft.sampling.reference import process_logits
from minedraft.sampling_params import SamplingParams
from conftest import engine_config
from sampling_law import DRAFT_LOGITS, TARGET_LOGITS, V, chi2_critical, chi2_stat

# -- selection ------------------------------------------------------------------------------------


def brute_force_counts(score: torch.Tensor, capacity: int) -> list[int]:
    """Rank (score desc, position asc, row asc) with plain Python and count each row's picks."""
    B, K = score.shape
    cells = sorted(((-float(score[b, j]), j, b) for b in range(B) for j in range(K)))[:capacity]
    return [sum(1 for _, _, b in cells if b == r) for r in range(B)]


@pytest.mark.parametrize("seed", range(6))
def test_select_keeps_the_best_prefixes_within_capacity(seed):
    g = torch.Generator().manual_seed(seed)
    B, K = 7, 5
    conf = -torch.rand(B, K, generator=g) * 2
    conf[conf > -0.4] = 0.0  # ties: rows with certain drafts
    conf = conf.round(decimals=1)  # more ties across rows
    score = tetris.scores(conf)
    for cap in (0, 1, 3, B - 1, B, 2 * B + 1, B * K, B * K + 4):
        counts = tetris.select(score, cap)
        assert counts.tolist() == brute_force_counts(score, cap)
        assert int(counts.sum()) == min(cap, B * K) and int(counts.max()) <= K
    # batched over a leading dimension: the same as one batch at a time
    many = torch.stack([score, score.flip(0)])
    assert torch.equal(tetris.select(many, 9), torch.stack([tetris.select(score, 9), tetris.select(score.flip(0), 9)]))


# -- exactness of the sampled law with Tetris on ----------------------------------------------------

# draft logits depend on the previous token, so confidences (and Tetris' choices) depend on the context
BIAS = torch.randn(V, V, generator=torch.Generator().manual_seed(7)) * 1.5


def tetris_trial(params: SamplingParams, groups: int, capacity: int, rank_on_drawn: bool, K: int = 3):
    """`groups` independent batches of 2 rows: draft K tokens each, keep `capacity` drafts per batch by
    Tetris, verify. rank_on_drawn: the wrong variant that ranks on the drawn tokens' own probabilities.
    Returns per row r: (counts of output token 0, counts of token 1, histogram of kept drafts)."""
    B = 2
    rows = groups * B
    rp = RowParams.of([params] * rows, list(range(rows)))
    pos0 = torch.full((rows,), 5, dtype=torch.long)
    prev = torch.tensor([0, 3] * groups)
    sharp = torch.tensor([2.0, 0.3] * groups)[:, None]  # a confident row beside a hesitant one
    toks, qs, confs = [], [], []
    for i in range(K):
        logits = (DRAFT_LOGITS[i % len(DRAFT_LOGITS)][None] + BIAS[prev]) * sharp
        t, q, conf = sample_draft_step(logits, rp, pos0 + i, torch.zeros(rows, dtype=torch.long))
        if rank_on_drawn:
            conf = torch.log(q.gather(1, t[:, None]).squeeze(1))
        toks.append(t)
        qs.append(q)
        confs.append(conf)
        prev = t
    drafts, q = torch.stack(toks, 1), torch.stack(qs, 1)
    counts = tetris.select(tetris.scores(torch.stack(confs, 1)).view(groups, B, K), capacity).view(rows)
    n, tok = verify_batch(TARGET_LOGITS[:K + 1].expand(rows, -1, -1), drafts, counts, q, rp, pos0)
    n, tok = torch.tensor(n), torch.tensor(tok)
    out0 = torch.where(n > 0, drafts[:, 0], tok)
    out1 = torch.where(n > 1, drafts[:, 1], tok)
    result = []
    for r in range(B):
        sel = torch.arange(rows) % B == r
        result.append((torch.bincount(out0[sel], minlength=V), torch.bincount(out1[sel & (n > 0)], minlength=V),
                       torch.bincount(counts[sel], minlength=K + 1)))
    return result


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)],
                         ids=["t1", "t0.7-topk4"])
def test_tetris_output_follows_target(params):
    p = process_logits(TARGET_LOGITS, params)
    for c0, c1, kept in tetris_trial(params, 15_000, 3, rank_on_drawn=False):
        assert (kept > 500).sum() >= 2, kept.tolist()  # the selection really varies per row
        for counts, probs in ((c0, p[0]), (c1, p[1])):
            stat, dof = chi2_stat(counts, probs)
            assert stat < chi2_critical(dof), f"chi2={stat:.1f} counts={counts.tolist()} p={probs.tolist()}"


def test_statistic_rejects_ranking_on_the_drawn_tokens():
    """Ranking on q(x) of the drafted token itself (the obvious reading of 'cumulative draft log-prob')
    keeps likely-looking drafts more often, so kept drafts no longer follow q: the output law drifts."""
    params = SamplingParams(temperature=1.0)
    p = process_logits(TARGET_LOGITS, params)
    worst = max(chi2_stat(c0, p[0])[0] for c0, _, _ in tetris_trial(params, 15_000, 1, rank_on_drawn=True))
    assert worst > 5 * chi2_critical(V - 1), worst


# -- engines: greedy identity, ragged counts, seeds ------------------------------------------------

WORDS = "the for statement while class def return import lambda yield with try except raise".split()


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(n)]


_cfg = functools.partial(engine_config, k=3, max_prompt_tokens=128, max_tokens_limit=64, kv_cache_tokens=16384, max_batch_size=16)


@pytest.fixture(scope="module")
def greedy_ref(tiny_pair):
    ref = LocalEngine(_cfg(tiny_pair, mode="autoregressive"))
    return lambda prompts, n: [r.token_ids for r in ref.generate(prompts, SamplingParams(max_tokens=n,
                                                                                          ignore_eos=True))]


def _record_counts(verifier) -> list[list[int]]:
    """Wrap verifier.verify to record each step's per-row draft counts, read from its verdicts."""
    steps, inner = [], verifier.verify

    def verify(rids, drafts, q):
        res = inner(rids, drafts, q)
        steps.append([r.num_drafted for r in res])
        return res
    verifier.verify = verify
    return steps


@pytest.mark.parametrize("k,extra,capacity", [(2, 0, 7), (3, 2, None), (2, 3, 5), (4, 1, 40)])
def test_local_tetris_greedy_equals_target_alone(tiny_pair, greedy_ref, k, extra, capacity):
    prompts = _prompts(10, seed=k)
    eng = LocalEngine(_cfg(tiny_pair, mode="sequential", k=k, tetris=True, tetris_extra=extra,
                           tetris_capacity=capacity))
    steps = _record_counts(eng.verifier)
    out = [r.token_ids for r in eng.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))]
    assert out == greedy_ref(prompts, 20)
    full = [s for s in steps if len(s) == len(prompts)]
    budget = k * len(prompts) if capacity is None else capacity
    assert all(sum(s) <= budget and max(s) <= k + extra for s in full)
    assert sum(1 for s in full if len(set(s)) > 1) >= len(full) // 2, full  # ragged in most steps
    assert_cache_empty(eng)


def assert_cache_empty(eng):
    assert eng.target.cache.num_seqs == 0 and eng.draft.cache.num_seqs == 0


def _seeded(seed, n=20):
    return SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=n, ignore_eos=True)


def test_local_tetris_seeded_output_ignores_its_batch(tiny_pair):
    """Seeded rows are coupled (batch_sampling): the same tokens alone, in a crowd, with Tetris on or off,
    and as target-alone decoding with that seed."""
    prompts = _prompts(4, seed=9)
    tet = LocalEngine(_cfg(tiny_pair, mode="sequential", tetris=True, tetris_capacity=3))
    alone = [tet.generate([p], [_seeded(i)])[0].token_ids for i, p in enumerate(prompts)]
    crowd_prompts = prompts + _prompts(8, seed=10)
    crowd_params = [_seeded(i) for i in range(4)] + [SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True),
                                                     SamplingParams(max_tokens=25, ignore_eos=True)] * 4
    crowd = [r.token_ids for r in tet.generate(crowd_prompts, crowd_params)[:4]]
    ar = LocalEngine(_cfg(tiny_pair, mode="autoregressive"))
    target_alone = [r.token_ids for r in ar.generate(prompts, [_seeded(i) for i in range(4)])]
    assert alone == crowd == target_alone
    assert len({tuple(t) for t in alone}) == 4


async def test_pipeline_tetris_greedy_identity_and_ragged_verdicts(tiny_pair, greedy_ref):
    prompts = _prompts(12, seed=3)
    async with Engine(_cfg(tiny_pair, tetris=True, tetris_extra=2, tetris_capacity=4)) as engine:
        verdicts = []
        engine.scheduler.verdict_listeners.append(verdicts.append)
        results = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=16, ignore_eos=True))
                                         for p in prompts))
    assert [r.token_ids for r in results] == greedy_ref(prompts, 16)
    counts = [[r.num_drafted for r in m.results] for m in verdicts]
    assert all(sum(c) <= 4 for c in counts)
    assert sum(1 for c in counts if len(set(c)) > 1) >= 3, counts  # rows of one step got different counts
    assert max(max(c) for c in counts) > 3  # some row got more than k: it used the extra drafts


async def test_pipeline_seeded_output_ignores_batch_with_tetris_and_dynamic_k(tiny_pair):
    prompt = "the class statement"
    cfg = _cfg(tiny_pair, tetris=True, adaptive_k=True)
    async with Engine(cfg) as engine:
        alone = (await engine.generate(prompt, _seeded(77, 24))).token_ids
        others = [engine.generate(p, SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True))
                  for p in _prompts(9, seed=4)]
        crowd = await asyncio.gather(engine.generate(prompt, _seeded(77, 24)), *others)
    ar = LocalEngine(_cfg(tiny_pair, mode="autoregressive"))
    assert alone == crowd[0].token_ids == ar.generate([prompt], [_seeded(77, 24)])[0].token_ids


def test_draft_slots_carry_ragged_rows():
    """The shared-memory slot round-trips per-row counts, padded tokens and q (what the verifier reads)."""
    from minedraft.ipc.shm import create_shm, destroy_shm, slot_nbytes
    from minedraft.ipc.tensors import DraftSlots
    segs = create_shm(2, slot_nbytes(4, 5, 7))
    try:
        slots = DraftSlots.attach_shm([s.name for s in segs])
        drafts = [[1, 2, 3, 4, 5], [], [6], [0, 6]]
        q = torch.rand(4, 5, 7)
        desc = slots.write(1, drafts, q)
        got, got_q = slots.read(desc)
        assert got == drafts and torch.equal(got_q, q)
        assert slots.read(slots.write(0, [[], []], None)) == ([[], []], None)
        slots.close()
    finally:
        destroy_shm(segs)
