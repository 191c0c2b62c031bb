"""Distil a small draft for SmolLM2-135M-Instruct (the `minedraft models pull smollm2-135m` target).

Phases (each resumable; outputs under --work, default out/smollm2-draft):
  gen     the target answers chat prompts (minedraft/bench/prompts.py) greedily; for every generated position we
          keep its token and the target's top-16 log-probabilities (soft labels). Shards are written as they finish.
  vocab   the draft's output vocabulary: the most frequent target tokens in those answers (plus special tokens).
  train   a 2-layer Llama draft at the target's width, initialised from the target's embedding rows, last two
          layers and final norm, trained on hard + soft labels; checkpoints every few hundred steps.
  export  fp16 weights + config + draft_vocab.json into minedraft/models/smollm2-135m-draft.
  eval    greedy acceptance at k = 1..6 on held-out chat prompts through minedraft's own Drafter/Verifier, and the
          draft's cost relative to the target's (Td/Tv), written to the draft folder's report.json.

    python scripts/train/smollm2_draft.py all            # or one phase: gen | vocab | train | export | eval
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from minedraft.bench.prompts import held_out_prompts, train_prompts
from minedraft.models.distill import greedy_rows

ROOT = Path(__file__).resolve().parents[2]
EXPORT = ROOT / "minedraft" / "models" / "smollm2-135m-draft"
AUTOCAST = True  # bf16 matmuls in training (3-4x faster on AMX/AVX512-BF16 hosts); weights and optimiser stay fp32


def target_dir(args) -> str:
    if args.target:
        return args.target
    from minedraft.models.hub import pair_dirs
    return str(pair_dirs("smollm2-135m")[0])


def load_target(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    return tok, model


def chat_ids(tok, prompt: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


# -- gen -------------------------------------------------------------------------------------------------------
@torch.inference_mode()
def phase_gen(args):
    """Greedy answers through minedraft's own ModelRunner (paged KV, one ragged forward per step): on a CPU it
    runs several times faster than transformers' generate for this 30-layer model."""
    from tqdm import tqdm
    from transformers import AutoTokenizer
    from minedraft.runner.model_runner import ModelRunner
    tdir = target_dir(args)
    tok = AutoTokenizer.from_pretrained(tdir, local_files_only=True)
    B = args.gen_batch
    runner = ModelRunner.from_pretrained(tdir, B * (args.max_new + 160), 16, dtype=args.gen_dtype)
    out = Path(args.work) / "gen"
    out.mkdir(parents=True, exist_ok=True)
    prompts = (train_prompts() if args.prompts == "chat" else wide_prompts(tok))[: args.num_prompts]
    tag = "" if args.prompts == "chat" else "w_"
    deadline = time.time() + args.gen_minutes * 60 if args.gen_minutes else None
    bar = tqdm(range(0, len(prompts), B), desc="gen", unit="batch")
    for s in bar:
        path = out / f"shard_{tag}{s // B:05d}.pt"
        if path.exists():
            continue
        if deadline and time.time() > deadline:
            print("gen: time budget spent; rerun to continue", file=sys.stderr)
            break
        batch = [chat_ids(tok, p) for p in prompts[s:s + B]]
        t0 = time.time()
        rows = greedy_rows(runner, batch, args.max_new, tok.eos_token_id, args.features)
        torch.save(rows, path)
        bar.set_postfix(tok_s=f"{sum(len(r['gen']) for r in rows) / (time.time() - t0):.0f}")


def wide_prompts(tok) -> list[str]:
    """Many more topics than chat_prompts has: the English words of the target's vocabulary (single tokens,
    lowercase, 5-13 letters), one training template each. Words sharing a stem with a held-out topic are left out,
    so acceptance on the held-out prompts still measures unseen topics."""
    from minedraft.bench.prompts import HELD_OUT_TOPICS, TRAIN_TEMPLATES, _topics
    stems = {w[:5].lower() for t in _topics(HELD_OUT_TOPICS) for w in t.split() if len(w) >= 5}
    words = sorted(w[1:] for w in tok.get_vocab() if w.startswith("\u0120") and w[1:].isalpha()
                   and w[1:].islower() and 5 <= len(w) <= 14 and w[1:6] not in stems)
    rng = random.Random(0)
    out = [rng.choice(TRAIN_TEMPLATES).format(t=w) for w in words]
    rng.shuffle(out)
    return out


def load_rows(work) -> list[dict]:
    rows = []
    for p in sorted((Path(work) / "gen").glob("shard_*.pt")):
        rows += torch.load(p)
    return rows


# -- vocab -----------------------------------------------------------------------------------------------------
def phase_vocab(args):
    rows = load_rows(args.work)
    gen = Counter(t for r in rows for t in r["gen"])
    total = sum(gen.values())
    keep = [0, 1, 2] + [t for t, _ in gen.most_common() if t not in (0, 1, 2)]
    keep = keep[: args.vocab]
    cover = sum(gen[t] for t in keep) / total
    # inputs also come from prompts: add their most frequent tokens while room is left
    json.dump({"token_ids": sorted(keep), "coverage_of_generated": cover, "generated_tokens": total},
              open(Path(args.work) / "vocab.json", "w"))
    print(f"vocab: {len(keep)} tokens cover {cover:.4f} of {total} generated tokens "
          f"({len(gen)} distinct)")


# -- model -----------------------------------------------------------------------------------------------------
def build_draft(target, token_ids: list[int], layers: list[int]):
    """A Llama at the target's width whose vocabulary is token_ids + one 'other' row (inputs outside the subset)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tc = target.config
    cfg = LlamaConfig(vocab_size=len(token_ids) + 1, hidden_size=tc.hidden_size,
                      intermediate_size=tc.intermediate_size, num_hidden_layers=len(layers),
                      num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                      head_dim=getattr(tc, "head_dim", tc.hidden_size // tc.num_attention_heads),
                      max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
                      rope_parameters=dict(tc.rope_parameters), tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    draft = LlamaForCausalLM(cfg)
    with torch.no_grad():
        E = target.model.embed_tokens.weight
        ids = torch.tensor(token_ids)
        draft.model.embed_tokens.weight[:-1] = E[ids]
        draft.model.embed_tokens.weight[-1] = E.mean(0)
        for j, li in enumerate(layers):
            draft.model.layers[j].load_state_dict(target.model.layers[li].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.tie_weights()
    return draft


def make_examples(rows, tmap, other: int, max_len: int):
    """(input draft ids, positions with labels, hard label, soft idx, soft logp) per row, cut to max_len."""
    ex = []
    for r in rows:
        seq = r["prompt"] + r["gen"]
        p = len(r["prompt"])
        seq = seq[:max_len + 1]
        n = len(seq) - p                      # labelled positions: predicting seq[p .. p+n-1]
        if n <= 0:
            continue
        inp = tmap[torch.tensor(seq[:-1] if len(seq) > p else seq)]
        ex.append((inp, p - 1, n, r["top_i"][:n].long(), r["top_v"][:n].float()))
    return ex


def batch_loss(draft, batch, tmap, other, soft_w: float):
    L = max(e[0].shape[0] for e in batch)
    ids = torch.full((len(batch), L), other, dtype=torch.long)
    att = torch.zeros(len(batch), L, dtype=torch.long)
    for i, e in enumerate(batch):
        ids[i, :e[0].shape[0]] = e[0]
        att[i, :e[0].shape[0]] = 1
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=AUTOCAST):
        logits = draft(input_ids=ids, attention_mask=att).logits   # [B, L, Vd]
    logits = logits.float()
    hard_l, soft_l, n_all, agree = 0.0, 0.0, 0, 0
    for i, (inp, start, n, ti, tv) in enumerate(batch):
        lg = logits[i, start:start + n]                             # predicts generated tokens
        lg = lg[:, :-1]                                             # the 'other' row is never a label
        lp = torch.log_softmax(lg, -1)
        di = tmap[ti]                                               # [n, 16] draft ids (other = not in vocab)
        ok = di != other
        w = tv.exp() * ok
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-9)
        di = di.clamp(max=lg.shape[-1] - 1)
        soft_l = soft_l - (w * lp.gather(-1, di)).sum()
        hard = di[:, 0]
        hok = ok[:, 0]
        hard_l = hard_l - lp.gather(-1, hard[:, None])[:, 0][hok].sum()
        agree += int(((lg.argmax(-1) == hard) & hok).sum())
        n_all += n
    loss = (hard_l + soft_w * soft_l) / n_all
    return loss, agree / n_all


def phase_train(args):
    from tqdm import tqdm
    torch.manual_seed(0)
    _, target = load_target(target_dir(args))
    vocab = json.load(open(Path(args.work) / "vocab.json"))["token_ids"]
    other = len(vocab)
    tmap = torch.full((target.config.vocab_size,), other, dtype=torch.long)
    tmap[torch.tensor(vocab)] = torch.arange(len(vocab))
    layers = [int(x) for x in args.layers.split(",")]
    ckpt = Path(args.work) / "draft.pt"
    draft = build_draft(target, vocab, layers)
    del target
    rows = load_rows(args.work)
    random.Random(0).shuffle(rows)
    n_val = max(16, len(rows) // 40)
    val, train = make_examples(rows[:n_val], tmap, other, args.max_len), make_examples(rows[n_val:], tmap, other,
                                                                                        args.max_len)
    steps_per_epoch = math.ceil(len(train) / args.batch)
    total = steps_per_epoch * args.epochs
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    step = 0
    if not ckpt.exists() and args.init_from:
        # continue from an earlier draft's weights with a fresh optimiser and schedule (e.g. on more data)
        draft.load_state_dict(torch.load(args.init_from)["model"])
        print(f"train: weights from {args.init_from}", file=sys.stderr)
    if ckpt.exists():
        st = torch.load(ckpt)
        draft.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
        print(f"train: resumed at step {step}/{total}", file=sys.stderr)
    sched = lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))  # noqa
    draft.train()
    bar = tqdm(total=total, initial=step, desc="train", unit="step")
    order_rng = random.Random(1)
    while step < total:
        epoch, pos = divmod(step, steps_per_epoch)
        order = list(range(len(train)))
        random.Random(epoch).shuffle(order)
        idx = order[pos * args.batch:(pos + 1) * args.batch]
        for g in opt.param_groups:
            g["lr"] = args.lr * sched(step)
        loss, acc = batch_loss(draft, [train[i] for i in idx], tmap, other, args.soft)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update()
        bar.set_postfix(loss=f"{loss.item():.3f}", agree=f"{acc:.3f}")
        if step % args.ckpt_every == 0 or step == total:
            draft.eval()
            with torch.no_grad():
                vl = [batch_loss(draft, val[i:i + args.batch], tmap, other, args.soft) for i in
                      range(0, len(val), args.batch)]
            draft.train()
            va = sum(a for _, a in vl) / len(vl)
            tqdm.write(f"step {step}: val top-1 agreement {va:.4f}")
            torch.save({"model": draft.state_dict(), "opt": opt.state_dict(), "step": step, "val_agree": va}, ckpt)
    del order_rng


# -- export ----------------------------------------------------------------------------------------------------
def phase_export(args):
    _, target = load_target(target_dir(args))
    vocab = json.load(open(Path(args.work) / "vocab.json"))["token_ids"]
    draft = build_draft(target, vocab, [int(x) for x in args.layers.split(",")])
    st = torch.load(Path(args.work) / "draft.pt")
    draft.load_state_dict(st["model"])
    draft.config.dtype = "float16"
    out = Path(args.export_dir)
    out.mkdir(parents=True, exist_ok=True)
    draft.half().save_pretrained(out, safe_serialization=True)
    json.dump({"target_vocab_size": target.config.vocab_size, "token_ids": vocab}, open(out / "draft_vocab.json", "w"))
    print(f"exported to {out} (val top-1 agreement {st['val_agree']:.4f})")


# -- eval ------------------------------------------------------------------------------------------------------
def phase_eval(args):
    from minedraft.config import EngineConfig
    from minedraft.engine.local_engine import LocalEngine
    from minedraft.sampling_params import SamplingParams
    from minedraft.runner.model_runner import ModelRunner
    from transformers import AutoTokenizer
    torch.set_num_threads(1)
    tdir = target_dir(args)
    tok = AutoTokenizer.from_pretrained(tdir, local_files_only=True)
    prompts = [chat_ids(tok, p) for p in held_out_prompts()]
    params = SamplingParams(max_tokens=args.eval_tokens)
    report = {"prompts": len(prompts), "max_tokens": args.eval_tokens, "acceptance": {}}
    for k in range(1, 7):
        eng = LocalEngine(EngineConfig(target=tdir, draft=args.export_dir, mode="sequential", k=k,
                                       max_batch_size=len(prompts)))
        res = eng.generate([tok.decode(p) for p in prompts], params)
        acc = sum(r.stats.accepted_tokens for r in res)
        drafted = sum(r.stats.draft_tokens for r in res)
        steps = sum(r.stats.steps for r in res)
        out = sum(len(r.token_ids) for r in res)
        report["acceptance"][k] = {"per_draft_token": acc / drafted, "tokens_per_step": out / steps}
        print(f"k={k}: acceptance {acc / drafted:.3f}, tokens/step {out / steps:.2f}", flush=True)
    # draft cost relative to the target: one decode step (1 token per row) at B = 1 and 16, one core
    tr = ModelRunner.from_pretrained(tdir, 8192)
    dr = ModelRunner.from_pretrained(args.export_dir, 8192)
    cost = {}
    for B in (1, 16):
        times = {}
        for name, r in (("target", tr), ("draft", dr)):
            seqs = list(range(B))
            for s in seqs:
                r.cache.allocate(s, 200)
            feed = [prompts[s % len(prompts)][:64] for s in seqs]
            kw = lambda f: {}  # noqa: E731
            if r.fc is not None:  # a feature-conditioned draft also reads a target feature per token
                kw = lambda f: {"features": [torch.zeros(len(t), r.hidden_size) for t in f], "hidden": True}  # noqa
            r.forward(seqs, feed, 1, **kw(feed))
            ts = []
            for _ in range(15):
                t0 = time.perf_counter()
                r.forward(seqs, [[5]] * B, 1, **kw([[5]] * B))
                ts.append(time.perf_counter() - t0)
                for s in seqs:
                    r.cache.truncate(s, r.cache.length(s) - 1)
            for s in seqs:
                r.cache.free(s)
            times[name] = sorted(ts)[len(ts) // 2]
        cost[B] = {"target_ms": times["target"] * 1e3, "draft_ms": times["draft"] * 1e3,
                   "td_over_tv": times["draft"] / times["target"]}
        print(f"B={B}: target {times['target'] * 1e3:.1f} ms, draft {times['draft'] * 1e3:.1f} ms per token, "
              f"Td/Tv {times['draft'] / times['target']:.3f}", flush=True)
    report["cost_one_core"] = cost
    json.dump(report, open(Path(args.export_dir) / "report.json", "w"), indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["gen", "vocab", "train", "export", "eval", "all"])
    ap.add_argument("--target", default=None, help="target folder (default: the pulled smollm2-135m)")
    ap.add_argument("--work", default=str(ROOT / "out" / "smollm2-draft"))
    ap.add_argument("--export-dir", default=str(EXPORT))
    ap.add_argument("--num-prompts", type=int, default=3040)
    ap.add_argument("--gen-batch", type=int, default=128)
    ap.add_argument("--prompts", choices=["chat", "wide"], default="chat",
                    help="chat: chat_prompts' topics x templates; wide: the vocabulary's English words as topics")
    ap.add_argument("--init-from", default=None, help="train: start from this checkpoint's weights (fresh optimiser)")
    ap.add_argument("--gen-minutes", type=float, default=0, help="stop generating after this long (0: no limit)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--features", action="store_true",
                    help="gen: also keep the target's final-norm hidden states (for scripts/train/eagle.py)")
    ap.add_argument("--gen-dtype", default="bfloat16",
                    help="bfloat16 runs 3-4x faster on AMX hosts; the labels are then the bf16 target's")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--layers", default="28,29", help="target layers the draft's layers start from")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--soft", type=float, default=1.0, help="weight of the soft-label loss")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--eval-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    phases = ["gen", "vocab", "train", "export", "eval"] if args.phase == "all" else [args.phase]
    for ph in phases:
        globals()[f"phase_{ph}"](args)


if __name__ == "__main__":
    main()
