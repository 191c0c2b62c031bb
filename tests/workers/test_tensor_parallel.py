"""Tensor parallelism on CPU with gloo: sharding, the step broadcast, and the engine with target_tp=2.

What is promised (and checked here):
  * each rank's shard is exactly its block of every weight (concatenated over ranks: the whole model), KV heads
    fewer than the ranks are replicated to the ranks whose query heads read them, and each rank holds about 1/N
    of the weight bytes;
  * followers replaying rank 0's step descriptions end with the same KV cache, bit for bit;
  * greedy output with target_tp=2 equals target_tp=1 (the target-alone runner) and transformers' generate, for
    Llama (1 KV head < 2 ranks, tied embeddings), Qwen2 (q/k/v bias) and Qwen3 (q/k norms, 1 KV head), the last
    also with draft_tp=2;
  * sampled output with target_tp=2 follows the target's distribution (chi-square);
  * a killed or hung rank fails every pending request promptly, and nothing is left behind.
"""

from __future__ import annotations

import functools

import asyncio
import os
import random
import signal
import time
from multiprocessing import shared_memory

import pytest
import torch

from conftest import INIT_RANGE, _common, engine_config
from sampling_law import chi2_critical, chi2_stat

from minedraft.engine.diagnostics import process_alive, shm_exists
from minedraft.engine.engine import Engine
from minedraft.errors import EngineDeadError
from minedraft.engine.local_engine import LocalEngine
from minedraft.sampling.reference import process_logits
from minedraft.sampling_params import SamplingParams
from minedraft.workers import spawn
from minedraft.workers import tp_ranks as tp_workers
from minedraft.runner.model_runner import ModelRunner
from minedraft.ipc.messages import NewRequest
from minedraft.runner.tensor_parallel import Shard, head_split, load_sharded, param_bytes
from minedraft.workers.verifier import Verifier

WORDS = ("the for statement while class def return import lambda yield with try except raise global "
         "nonlocal object method function module").split()


@pytest.fixture(scope="module")
def models(tiny_pair, tmp_path_factory):
    """name -> model dir, all on the tiny pair's tokenizer: the shapes tensor parallelism must handle."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_pair.target, local_files_only=True)
    root = tmp_path_factory.mktemp("tp_models")
    eos = tiny_pair.eos_token_id
    torch.manual_seed(15)
    llama = LlamaForCausalLM(LlamaConfig(**{**_common(eos), "num_key_value_heads": 1,
                                            "tie_word_embeddings": True})).eval()
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**{**_common(eos), "num_key_value_heads": 1, "head_dim": 16},
                                         use_sliding_window=False)).eval()
    with torch.no_grad():  # HF initialises the q/k norms to ones; make them matter
        for layer in qwen3.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    dirs = {"qwen2": tiny_pair.qwen2}
    for name, m in (("llama-kv1-tied", llama), ("qwen3-kv1", qwen3)):
        d = root / name
        m.save_pretrained(d)
        tok.save_pretrained(d)
        dirs[name] = str(d)
    assert llama.lm_head.weight is llama.model.embed_tokens.weight and INIT_RANGE > 0.1
    return dirs


_cfg = functools.partial(engine_config, k=3, max_prompt_tokens=256, max_tokens_limit=64, kv_cache_tokens=16384, max_batch_size=32, target_tp=2)


def _prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 16))) for _ in range(n)]


# -- sharding ----------------------------------------------------------------------------------------------------
def test_head_split_maps_query_heads_onto_their_kv_heads():
    # 8 query heads, 2 KV heads over 4 ranks: KV head 0 serves query heads 0-3 (ranks 0, 1), head 1 heads 4-7
    assert [head_split(8, 2, 4, r) for r in range(4)] == [
        (range(0, 2), range(0, 1)), (range(2, 4), range(0, 1)), (range(4, 6), range(1, 2)), (range(6, 8), range(1, 2))]
    assert head_split(8, 4, 2, 1) == (range(4, 8), range(2, 4))
    for bad in ((6, 2, 4), (8, 3, 2), (8, 8, 3)):
        with pytest.raises(ValueError):
            head_split(*bad, 0)


def _full_weights(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["llama-kv1-tied", "qwen2", "qwen3-kv1"])
def test_shards_partition_the_weights(models, name):
    full = _full_weights(models[name])
    shards = [load_sharded(models[name], Shard(r, 2)) for r in range(2)]
    cfg = full.config
    for li, layer in enumerate(full.model.layers):
        a = [s.model.layers[li].self_attn for s in shards]
        mlp = [s.model.layers[li].mlp for s in shards]
        assert torch.equal(torch.cat([x.q_proj.weight for x in a]), layer.self_attn.q_proj.weight)
        assert torch.equal(torch.cat([x.o_proj.weight for x in a], 1), layer.self_attn.o_proj.weight)
        assert torch.equal(torch.cat([x.up_proj.weight for x in mlp]), layer.mlp.up_proj.weight)
        assert torch.equal(torch.cat([x.down_proj.weight for x in mlp], 1), layer.mlp.down_proj.weight)
        for proj in ("k_proj", "v_proj"):
            w = getattr(layer.self_attn, proj).weight
            got = [getattr(x, proj).weight for x in a]
            if cfg.num_key_value_heads < 2:   # replicated: both ranks read the one KV head
                assert all(torch.equal(g, w) for g in got)
            else:
                assert torch.equal(torch.cat(got), w)
        if layer.self_attn.q_proj.bias is not None:
            assert torch.equal(torch.cat([x.q_proj.bias for x in a]), layer.self_attn.q_proj.bias)
        if hasattr(layer.self_attn, "q_norm"):
            assert all(torch.equal(x.q_norm.weight, layer.self_attn.q_norm.weight) for x in a)
    emb = torch.cat([s.model.embed_tokens.weight for s in shards])[:cfg.vocab_size]
    assert torch.equal(emb, full.model.embed_tokens.weight)
    assert torch.equal(torch.cat([s.lm_head.weight for s in shards])[:cfg.vocab_size], full.lm_head.weight)
    if cfg.tie_word_embeddings:
        assert all(s.lm_head.weight is s.model.embed_tokens.weight for s in shards)
    # each rank's resident weights: about half (replicated norms, and the KV projections when replicated)
    whole = param_bytes(full)
    for s in shards:
        share = param_bytes(s) / whole
        print(f"{name}: rank holds {param_bytes(s)} of {whole} weight bytes ({share:.3f})")
        assert 0.45 < share < (0.58 if cfg.num_key_value_heads < 2 else 0.52), share


def test_uneven_vocabulary_is_padded_and_trimmed(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(**{**_common(0), "vocab_size": 301})).eval()
    m.save_pretrained(tmp_path)
    shards = [load_sharded(str(tmp_path), Shard(r, 2)) for r in range(2)]
    assert [s.model.embed_tokens.rows for s in shards] == [151, 150]
    assert torch.equal(shards[1].lm_head.weight[150], torch.zeros(64))  # the pad row
    assert torch.equal(torch.cat([s.lm_head.weight for s in shards])[:301], m.lm_head.weight)


def test_tp1_shard_is_the_model(models):
    """The sharded modules with one rank compute what the Hugging Face model does, bit for bit."""
    full = _full_weights(models["qwen2"])
    one = load_sharded(models["qwen2"], Shard(0, 1))
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        assert torch.equal(one(ids).logits, full(ids).logits)


# -- the step description ----------------------------------------------------------------------------------------
def _hand_over_rank(rank: int, init: str, timeout_s: float, q) -> None:
    """Rank 0 hands over one step and then a second one, which rank 1 never takes (it is busy or frozen)."""
    import torch.distributed as dist
    from datetime import timedelta
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=tp_workers.IDLE)
    if rank == 1:
        q.put(("rank1", tp_workers.recv_step(dist.group.WORLD)))
        time.sleep(60)
        return
    tp_workers.send_step([7, 8, 9], dist.group.WORLD, timedelta(seconds=timeout_s))
    t0 = time.monotonic()
    try:
        tp_workers.send_step([1, 2], dist.group.WORLD, timedelta(seconds=timeout_s))
        q.put(("rank0", "returned", time.monotonic() - t0))
    except tp_workers.StepTimeout as e:
        q.put(("rank0", str(e), time.monotonic() - t0))
    q.close()
    q.join_thread()      # flush the message before leaving without the process group's teardown
    os._exit(0)


def test_leader_hand_over_is_bounded_by_the_tp_timeout(tmp_path):
    """The followers wait for the next step without limit (idleness), but rank 0 waits at most tp_timeout_s for
    them to take it: a follower that never does (here: asleep; in life: stopped or frozen) makes rank 0 raise."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{tmp_path}/init"
    procs = [ctx.Process(target=_hand_over_rank, args=(r, init, 1.0, q), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict((m[0], m[1:]) for m in (q.get(timeout=60), q.get(timeout=60)))
    finally:
        for p in procs:
            p.kill()
    assert got["rank1"] == ([7, 8, 9],)
    msg, waited = got["rank0"]
    assert "tp_timeout_s=1" in msg, msg
    assert 0.9 < waited < 10, waited


def test_followers_replay_the_leaders_steps_exactly(tiny_pair, monkeypatch):
    """A Verifier on a LeaderRunner; a follower replays the recorded broadcasts (HEADER shrunk so long steps take
    the two-broadcast path): same block tables, lengths and KV contents."""
    wire: list[torch.Tensor] = []
    leader_side = [True]

    def broadcast(t, src, group=None):
        if leader_side[0]:
            wire.append(t.clone())
        else:
            t.copy_(wire.pop(0))
    monkeypatch.setattr(tp_workers.dist, "broadcast", broadcast)
    monkeypatch.setattr(tp_workers, "HEADER", 16)

    def runner():
        return ModelRunner.from_pretrained(tiny_pair.target, kv_cache_tokens=2048, block_size=4)
    lead, follow = tp_workers.LeaderRunner(runner(), None), runner()
    v = Verifier(lead, 3, [tiny_pair.eos_token_id])
    rng = random.Random(0)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    reqs = [NewRequest(i, [rng.randrange(1, 300) for _ in range(rng.randint(1, 30))], params, i) for i in range(6)]
    for r in reqs[:4]:
        v.add(r)
    steps = 0
    while v.seqs:
        rids = sorted(v.seqs)
        v.verify(rids, [[rng.randrange(1, 300) for _ in range(3)] for _ in rids], None)
        steps += 1
        if steps == 2:
            v.remove(reqs[0].rid)       # an abort, sent with the next step
            for r in reqs[4:]:
                v.add(r)
    lead.stop_followers()
    leader_side[0] = False
    n = 0
    while tp_workers.replay(follow, tp_workers.recv_step(None)):
        n += 1
    assert n == steps and not wire
    a, b = lead.cache, follow.cache
    assert a._tables == b._tables and a._lengths == b._lengths and a.num_seqs == 0
    for li in range(len(b.k)):
        assert torch.equal(a.k[li], b.k[li]) and torch.equal(a.v[li], b.v[li])


# -- the engine with target_tp=2 ---------------------------------------------------------------------------------
def _hf_generate(path, tok, prompts, n, eos):
    """(token ids, finish reason) from transformers' generate(do_sample=False), eos left out as minedraft does."""
    m = _full_weights(path)
    out = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p)])
        with torch.no_grad():
            g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           pad_token_id=eos)[0, ids.shape[1]:].tolist()
        out.append((g[:g.index(eos)], "stop") if eos in g else (g, "length"))
    return out


@pytest.mark.parametrize("name,draft_tp", [("llama-kv1-tied", 1), ("qwen2", 1), ("qwen3-kv1", 2)])
async def test_greedy_tp2_equals_tp1_and_transformers(tiny_pair, tiny_tokenizer, models, name, draft_tp):
    prompts, n = _prompts(10, seed=len(name)), 24
    params = SamplingParams(max_tokens=n)
    cfg = _cfg(tiny_pair, models[name], draft_tp=draft_tp)
    async with Engine(cfg) as engine:
        assert len(engine.procs) == 3 + (draft_tp - 1)
        results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        stats = engine.stats()
    tp1 = LocalEngine(_cfg(tiny_pair, models[name], mode="autoregressive", target_tp=1))
    expected_tp1 = [r.token_ids for r in tp1.generate(prompts, [params] * len(prompts))]
    hf = _hf_generate(models[name], tiny_tokenizer, prompts, n, tiny_pair.eos_token_id)
    for r, e1, (eh, reason) in zip(results, expected_tp1, hf):
        assert r.token_ids == e1 == eh
        assert r.finish_reason == reason
    assert stats["draft_tokens"] > 0 and sum(len(r.token_ids) for r in results) > 5 * len(prompts)


async def test_sampled_tp2_follows_target_distribution(tiny_pair, models):
    """The first token of many seeded requests at temperature 1.5, against softmax of the transformers model's
    logits: a wrong gather order or a missing shard changes the law and fails the chi-square."""
    from transformers import AutoTokenizer
    path = models["llama-kv1-tied"]
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    prompt, trials = "the class statement", 1200
    sp = [SamplingParams(temperature=1.5, max_tokens=1, seed=1000 + i, ignore_eos=True) for i in range(trials)]
    async with Engine(_cfg(tiny_pair, path, max_queue=2 * trials)) as engine:
        results = await asyncio.gather(*(engine.generate(prompt, s) for s in sp))
    counts = torch.zeros(tiny_pair.vocab_size, dtype=torch.long)
    for r in results:
        counts[r.token_ids[0]] += 1
    with torch.no_grad():
        logits = _full_weights(path)(torch.tensor([tok.encode(prompt)])).logits[0, -1]
    p = process_logits(logits[None], sp[0])[0]
    # pool the tail (expected count < 5) into one bin so the statistic's chi-square approximation holds
    big = p * trials >= 5
    c = torch.cat([counts[big], counts[~big].sum()[None]])
    q = torch.cat([p[big], p[~big].sum()[None]])
    stat, dof = chi2_stat(c, q)
    assert dof >= 5, "too few bins to test anything: raise the temperature"
    assert stat < chi2_critical(dof), f"chi2={stat:.1f} dof={dof}"


async def _streams_running(engine, n: int, max_tokens: int = 60):
    got = [0] * n
    errors: list = [None] * n
    t_err = [None] * n

    async def one(i):
        try:
            async for d in engine.stream(f"the class {WORDS[i]}", SamplingParams(max_tokens=max_tokens,
                                                                                  ignore_eos=True)):
                got[i] += len(d.token_ids)
        except EngineDeadError as e:
            errors[i], t_err[i] = e, time.monotonic()
    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    deadline = time.monotonic() + 60
    while not all(got) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert all(got), "requests never started"
    return tasks, errors, t_err


@pytest.mark.parametrize("how", ["kill", "hang"])
async def test_dead_or_hung_rank_fails_pending_requests(tiny_pair, models, how):
    """SIGKILL of rank 1: the watchdog sees its exit. SIGSTOP of rank 1: rank 0's all_reduce, or its hand-over of
    the next step, times out after tp_timeout_s and rank 0 reports the error. Either way every request fails;
    shutdown leaves nothing behind."""
    timeout_s = 1.0
    engine = await Engine.start(_cfg(tiny_pair, models["qwen2"], max_tokens_limit=512, tp_timeout_s=timeout_s))
    try:
        pids = [p.pid for p in engine.procs]
        shm = [s.name for s in engine._shm]
        rank1 = next(p for p in engine.procs if p.name == "minedraft-verifier-rank1")
        tasks, errors, t_err = await _streams_running(engine, 6, max_tokens=500)
        t0 = time.monotonic()
        os.kill(rank1.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
        limit = 2.0 + (timeout_s if how == "hang" else 0.0)
        worst = max(t_err) - t0
        print(f"{how}: every request failed within {worst:.2f} s")
        assert worst < limit, worst
        assert not engine.health()["ok"]
        with pytest.raises(EngineDeadError):
            await engine.generate("again", SamplingParams(max_tokens=4))
    finally:
        await engine.shutdown()
    deadline = time.monotonic() + 5
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not any(process_alive(p) for p in pids)
    assert not any(shm_exists(n) for n in shm)


async def test_clean_shutdown_stops_every_rank(tiny_pair, models):
    """The stop reaches every rank of both roles (rank 0 broadcasts STOP) and each exits by itself with code 0,
    not killed; then nothing is left behind. (Exit takes seconds on a loaded box, so no time bound here.)"""
    engine = await Engine.start(_cfg(tiny_pair, models["qwen2"], draft_tp=2))
    try:
        await engine.generate("the def", SamplingParams(max_tokens=8))
        procs, shm = list(engine.procs), [s.name for s in engine._shm]
        assert len(procs) == 4
        engine._watch.cancel()   # as shutdown() does: a rank exiting on purpose is no failure
        engine.scheduler.send_stop()
        for p in procs:
            await asyncio.get_running_loop().run_in_executor(None, p.join, 60)
        assert all(p.exitcode == 0 for p in procs), [(p.name, p.exitcode) for p in procs]
    finally:
        await engine.shutdown()
    assert not any(process_alive(p.pid) for p in procs)
    assert not any(shm_exists(n) for n in shm)
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=shm[0])


# -- configuration -----------------------------------------------------------------------------------------------
def test_cli_flags_reach_the_config():
    from minedraft.cli import main as cli
    a = cli.build_parser().parse_args(["generate", "x", "--target-tp", "2", "--draft-tp", "2"])
    kw = cli._engine_kw(a)
    assert (kw["target_tp"], kw["draft_tp"]) == (2, 2)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "x", "--target-tp", "0"])


def test_bad_tp_sizes_fail_before_any_process(tiny_pair, models):
    with pytest.raises(ValueError, match="target_tp"):
        _cfg(tiny_pair, models["qwen2"], target_tp=0)

    async def start():
        engine = Engine(_cfg(tiny_pair, models["qwen2"], target_tp=3))   # 4 heads do not split over 3
        with pytest.raises(ValueError, match="tensor-parallel size 3"):
            await engine._start()
        assert engine.procs == []
    asyncio.run(start())


def test_ranks_split_their_roles_cores():
    assert spawn.split_cores([4, 5, 6, 7], 2) == [[4, 5], [6, 7]]
    assert spawn.split_cores([1, 2, 3], 2) == [[1], [2, 3]]
    assert spawn.split_cores([3], 2) == [[3], [3]]        # too few: shared
    assert spawn.split_cores([0, 1], 4) == [[0], [1], [0], [1]]
