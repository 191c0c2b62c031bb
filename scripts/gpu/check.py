#!/usr/bin/env python
"""One short prepared run for a lent GPU machine (see scripts/gpu/check.sh).

1. CUDA IPC transport: a child process attaches to the parent's CUDA draft slots through IPC handles and reads
   what the parent wrote, and writes back an answer the parent checks (no tensor is pickled, only handles).
2. Models of a realistic shape built from configs (no weights can be fetched there): a ~1B Llama-style target
   and a ~100M draft, bf16, randomly initialised. Random models never agree, so AGREEMENT IS FORCED BY
   CONSTRUCTION and stated in the output: attention and MLP output projections are zeroed (every matmul still
   runs, so the cost is the real one) and each model's head maps token x to perm(x); the draft uses a perm that
   differs from the target's on a chosen share of tokens, so its acceptance is set, not learned.
3. Tensor parallelism: with two or more GPUs (or --cpu-smoke, on CPU cores), the engine with target_tp=2
   generates greedily and its tokens are compared with the target alone at tp=1 (in process); with one GPU the
   line says it was skipped and why, and the rest still runs.
4. The benchmark table (autoregressive / sequential SD / minedraft) on those models.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch


def ipc_check() -> str:
    import torch.multiprocessing as tmp
    from minedraft.ipc.tensors import DraftSlots

    slots = DraftSlots.allocate_cuda(2, 1 << 20, "cuda:0")
    drafts = [[1, 2, 3], [4, 5, 6]]
    q = torch.rand(2, 3, 1000, device="cuda:0")
    desc = slots.write(1, drafts, q)
    ctx = tmp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_ipc_child, args=(slots.cuda_handles(), desc, child))
    p.start()
    got = parent.recv()
    p.join(60)
    ok = got["drafts"] == drafts and abs(got["q_sum"] - float(q.sum())) < 1e-2 * max(1.0, float(q.sum()))
    return f"CUDA IPC draft slots: {'OK' if ok else 'MISMATCH'} (child read drafts={got['drafts']}, q sum " \
           f"{got['q_sum']:.3f} vs {float(q.sum()):.3f})"


def _ipc_child(handles, desc, conn):
    from minedraft.ipc.tensors import DraftSlots
    slots = DraftSlots.attach_cuda(handles)
    d, q = slots.read(desc)
    conn.send({"drafts": d, "q_sum": float(q.sum())})


SHAPES = {  # name -> (LlamaConfig fields, vocab)
    "real": ({"target": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,   # TinyLlama-1.1B
                             num_attention_heads=32, num_key_value_heads=4),
              "draft": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8,      # ~100M class
                            num_attention_heads=12, num_key_value_heads=4)}, 32000),
    "tiny": ({"target": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,      # CPU smoke test
                             num_attention_heads=4, num_key_value_heads=2),
              "draft": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1)}, 1024),
}


def word_tokenizer(vocab: int):
    """A word-level tokenizer over the corpus's most frequent words, so the benchmark prompts map to many
    different ids (and so to many different forced chains) rather than all to unk."""
    from collections import Counter
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Counter(w for page in topics.values() for w in page.split())
    vocab_map = {"<unk>": 0, "<eos>": 1}
    for w, _ in words.most_common(vocab - 2):
        vocab_map.setdefault(w, len(vocab_map))
    while len(vocab_map) < vocab:
        vocab_map[f"<pad{len(vocab_map)}>"] = len(vocab_map)
    tk = Tokenizer(models.WordLevel(vocab_map, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")


def build_models(root: str, agree: float, device: str = "cuda", size: str = "real",
                 dtype=torch.bfloat16) -> tuple[str, str]:
    """Save a target and a draft whose greedy next token is perm(current token) (the draft's perm differs from
    the target's on a (1 - agree) share of tokens): the draft's acceptance is set by construction."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shapes, vocab = SHAPES[size]
    tok = word_tokenizer(vocab)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(vocab, generator=g)
    paths = {}
    for name, shape in shapes.items():
        cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=2048, eos_token_id=1, bos_token_id=1,
                          pad_token_id=1, tie_word_embeddings=False, **shape)
        with torch.device(device):
            m = LlamaForCausalLM(cfg).to(dtype)
        p = perm.clone()
        if name == "draft":  # disagree on a (1 - agree) share of tokens: rotate their images among themselves,
            flip = (torch.rand(vocab, generator=g) >= agree).nonzero().flatten()  # so p stays a permutation
            p[flip] = p[flip.roll(1)]
        with torch.no_grad():
            for layer in m.model.layers:  # zero residual branches: every matmul still runs, output = embedding
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            e = torch.randn(m.model.embed_tokens.weight.shape, generator=g)
            m.model.embed_tokens.weight.copy_(e)
            head = torch.empty_like(e)
            head[p] = e                     # logits[perm(x)] = e_x . norm(e_x): by far the largest
            m.lm_head.weight.copy_(head)
        paths[name] = os.path.join(root, name)
        m.save_pretrained(paths[name])
        tok.save_pretrained(paths[name])
        del m
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return paths["target"], paths["draft"]


def tp_check(target: str, draft: str, cpu: bool, prompts: int = 8, max_tokens: int = 32) -> str:
    """target_tp=2 against tp=1: identical greedy tokens (share of prompts) and the tp=2 engine's tokens/s."""
    n = torch.cuda.device_count() if not cpu else 0
    if not cpu and n < 2:
        return f"target_tp=2: skipped, {n} GPU visible (needs 2)"
    import asyncio
    from minedraft.bench.runner import corpus_prompts
    from minedraft.config import EngineConfig
    from minedraft.engine.engine import Engine
    from minedraft.engine.local_engine import LocalEngine
    from minedraft.sampling_params import SamplingParams
    from minedraft.workers.spawn import rank_device

    texts, dev = corpus_prompts(prompts, seed=7), "cpu" if cpu else "auto"
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    kw = dict(target=target, draft=draft, dtype="bfloat16", k=4, max_prompt_tokens=128,
              max_tokens_limit=max_tokens, kv_cache_tokens=16384, target_device=dev, draft_device=dev)

    async def run():
        async with Engine(EngineConfig(**kw, target_tp=2)) as engine:
            t = time.perf_counter()
            res = await asyncio.gather(*(engine.generate(p, params) for p in texts))
            return res, time.perf_counter() - t
    res, dt = asyncio.run(run())
    devices = ["cpu", "cpu"] if cpu else [rank_device("cuda:0", r) for r in range(2)]
    ref = LocalEngine(EngineConfig(**kw, mode="autoregressive")).generate(texts, [params] * len(texts))
    same = sum(a.token_ids == b.token_ids for a, b in zip(res, ref))
    toks = sum(len(r.token_ids) for r in res)
    return (f"target_tp=2 on {', '.join(devices)}: {same}/{len(texts)} greedy outputs identical to tp=1; "
            f"{toks / dt:.0f} tok/s ({len(texts)} prompts x {max_tokens} tokens, bf16)")


def default_plot_path(env=os.environ) -> str:
    """Under $OUT when the device runner sets it (its files come back from there), else under out/ (git-ignored):
    never the current directory, where a stray run once left a PNG committed at the repository root."""
    out = env.get("OUT") or os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "out")
    return os.path.join(out, "gpu_timeline.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", default=None, metavar="PNG", help="where to write the timeline (default: "
                    "$OUT/gpu_timeline.png, or out/gpu_timeline.png without $OUT)")
    ap.add_argument("--agree", type=float, default=0.8, help="forced per-token draft agreement")
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--k", type=int, nargs="+", default=[4])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny models on the CPU, no IPC check: proves the script itself before a GPU is lent")
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        device, size = "cpu", "tiny"
        print(f"torch {torch.__version__}, CPU smoke run (tiny models, no CUDA IPC check), 0 GPU(s)")
    else:
        device, size = "cuda", "real"
        print(f"torch {torch.__version__}, {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
        print(ipc_check(), flush=True)
    root = tempfile.mkdtemp()
    t = time.time()
    target, draft = build_models(root, a.agree, device, size)
    print(f"built models in {time.time() - t:.0f} s; agreement forced by construction at {a.agree:.0%} per token "
          f"(zeroed residual branches, permutation heads)", flush=True)
    print(tp_check(target, draft, a.cpu_smoke), flush=True)
    from minedraft.bench.runner import main as bench
    plot = a.plot or default_plot_path()
    os.makedirs(os.path.dirname(os.path.abspath(plot)), exist_ok=True)
    args = ["--target", target, "--draft", draft, "--dtype", "bfloat16", "--repeats", str(a.repeats),
            "--max-tokens", str(a.max_tokens), "--batch", *map(str, a.batch), "--k", *map(str, a.k), "--plot",
            plot, "--plot-seconds", "0.5", "--no-dynamic"]  # fixed-k rows only: the run must fit the lease
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
