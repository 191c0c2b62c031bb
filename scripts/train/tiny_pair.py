#!/usr/bin/env python
"""Train the bundled tiny draft/target pair used by minedraft's tests and demos.

Produces two Llama-style causal LMs that share one byte-level BPE tokenizer:

    minedraft/models/tiny-target/   6 layers, d=256   (~4.9M params)
    minedraft/models/tiny-draft/    1 layer,  d=128   (~0.45M params)

The corpus is the Python documentation bundled with CPython
(``pydoc_data.topics.topics``), so the script runs fully offline.

Pipeline
  1. split pages into train / held-out eval (~5% of characters)
  2. train a 2048-entry byte-level BPE tokenizer on the train pages
  3. train the target with next-token CE on random 256-token windows
  4. distil the draft from the frozen target (KL(target || draft), optional CE),
     with the target's log-probs cached once on strided corpus windows and on
     the target's own generations
  5. measure greedy agreement / expected tokens per speculative step,
     sample some text, save everything in HF format (fp16 safetensors),
     and write README.md + training_report.json next to the models.

Both training phases stop on a wall-clock budget (``--target-minutes``,
``--draft-minutes``) or a step cap, whichever comes first.  The learning-rate
schedule (linear warmup + cosine) follows ``max(step/max_steps,
elapsed/budget)``, so it anneals properly whichever limit ends the run.

Usage (2 CPU threads, ~25 min):
    nice -n 10 python scripts/train/tiny_pair.py
Draft only (keeps the saved target and tokenizer; replaces the draft only if
its greedy agreement improves on the saved report's):
    nice -n 10 python scripts/train/tiny_pair.py --reuse-target --draft-minutes 10
Quick smoke run:
    python scripts/train/tiny_pair.py --target-minutes 0.3 --draft-minutes 0.2 \
        --out-dir /tmp/tiny-models
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[2]
EOS = "<|endoftext|>"
VOCAB_SIZE = 2048


# ----------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------


def load_pages() -> dict[str, str]:
    from pydoc_data.topics import topics

    return {k: topics[k] for k in sorted(topics)}


def split_pages(pages: dict[str, str], eval_frac: float, seed: int):
    """Deterministically hold out pages until ~eval_frac of the characters.

    Pages are visited in a seeded random order; a page is taken only if it
    does not push the held-out set past 1.25x the target size, so one huge
    page cannot swallow the whole eval budget.
    """
    names = list(pages)
    random.Random(seed).shuffle(names)
    total = sum(len(v) for v in pages.values())
    goal = eval_frac * total
    eval_names: list[str] = []
    got = 0
    for n in names:
        if got >= goal:
            break
        if got + len(pages[n]) <= 1.25 * goal:
            eval_names.append(n)
            got += len(pages[n])
    eval_set = set(eval_names)
    train_names = [n for n in pages if n not in eval_set]
    eval_names = sorted(eval_names)
    return train_names, eval_names


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    from minedraft.engine.chat import CHATML_TEMPLATE
    hf_tok.chat_template = CHATML_TEMPLATE  # so Engine.chat works on the bundled pair
    return hf_tok


def encode_pages(tok, names: list[str], pages: dict[str, str]) -> torch.Tensor:
    """Concatenate pages as  page0 <eos> page1 <eos> ... (eos between pages)."""
    ids: list[int] = []
    for i, n in enumerate(names):
        if i:
            ids.append(tok.eos_token_id)
        ids.extend(tok.encode(pages[n], add_special_tokens=False))
    return torch.tensor(ids, dtype=torch.long)


def random_windows(data: torch.Tensor, batch: int, length: int, gen: torch.Generator):
    starts = torch.randint(0, len(data) - length, (batch,), generator=gen)
    return torch.stack([data[s : s + length] for s in starts.tolist()])


def eval_windows(data: torch.Tensor, length: int) -> torch.Tensor:
    n = len(data) // length
    return data[: n * length].view(n, length)


def eval_prompts(tok, eval_names, pages, n_prompts: int, prompt_len: int):
    """First `prompt_len` tokens of each held-out page, then (because there are
    only a handful of held-out pages) first `prompt_len` tokens starting at
    evenly spaced paragraph starts inside those pages."""
    page_starts, para_starts = [], []
    for n in eval_names:
        text = pages[n]
        offs = [0] + [i + 2 for i in range(len(text) - 2) if text[i : i + 2] == "\n\n" and text[i + 2] not in "\n"]
        for j, off in enumerate(offs):
            ids = tok.encode(text[off : off + 4 * prompt_len * 8], add_special_tokens=False)
            if len(ids) < prompt_len:
                continue
            (page_starts if j == 0 else para_starts).append((n, off, ids[:prompt_len]))
    out = list(page_starts[:n_prompts])
    need = n_prompts - len(out)
    if need > 0:
        if len(para_starts) < need:
            raise RuntimeError(f"only {len(out) + len(para_starts)} eval prompts available")
        step = len(para_starts) / need
        out += [para_starts[int(i * step)] for i in range(need)]
    return out


# ----------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------


def make_config(tok, *, hidden, inter, layers, heads, kv_heads):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def make_optimizer(model, lr, wd):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def lr_at(step, progress, base_lr, warmup, min_ratio=0.1):
    if step < warmup:
        return base_lr * (step + 1) / warmup
    p = min(max(progress, 0.0), 1.0)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def ce_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


@torch.no_grad()
def eval_ce(model, windows: torch.Tensor, bs: int = 8) -> float:
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(windows), bs):
        x = windows[i : i + bs]
        logits = model(x).logits.float()
        tot += ce_loss(logits, x).item() * x.size(0)
        n += x.size(0)
    return tot / max(n, 1)


@torch.no_grad()
def eval_distill(draft, target, windows: torch.Tensor, bs: int = 8):
    """KL(target||draft) per token and teacher-forced argmax agreement on real text."""
    draft.eval()
    target.eval()
    kl_tot, agree, n_tok = 0.0, 0, 0
    for i in range(0, len(windows), bs):
        x = windows[i : i + bs]
        tl = target(x).logits.float()
        dl = draft(x).logits.float()
        kl = F.kl_div(F.log_softmax(dl, -1), F.log_softmax(tl, -1), log_target=True, reduction="sum")
        kl_tot += kl.item()
        agree += (tl.argmax(-1) == dl.argmax(-1)).sum().item()
        n_tok += x.numel()
    return kl_tot / n_tok, agree / n_tok


def train_loop(
    name, model, step_fn, *, lr, warmup, minutes, max_steps, wd, log_every, grad_clip=1.0, eval_fn=None, eval_every=50
):
    """Optimise `model` with `step_fn()` until the step cap or wall-clock budget.

    If `eval_fn` is given it is called every `eval_every` steps (and at the end);
    the weights with the lowest eval value are restored at the end (the corpus
    is small, so the target can start to overfit late in the run)."""
    import copy

    from tqdm import tqdm

    opt = make_optimizer(model, lr, wd)
    budget = minutes * 60.0
    t0 = time.time()
    step = 0
    ema = None
    history = []
    best = (float("inf"), None, 0)
    bar = tqdm(total=max_steps, desc=name, dynamic_ncols=True, mininterval=5.0, file=sys.stdout)
    model.train()
    while True:
        elapsed = time.time() - t0
        progress = max(step / max_steps, elapsed / budget)
        if progress >= 1.0:
            break
        cur_lr = lr_at(step, progress, lr, warmup)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        loss, extra = step_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        step += 1
        li = loss.item()
        ema = li if ema is None else 0.98 * ema + 0.02 * li
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{cur_lr:.2e}", t=f"{elapsed / 60:.1f}m", **extra)
        rec = None
        if step % log_every == 0:
            rec = {"step": step, "loss_ema": round(ema, 4), "elapsed_s": round(elapsed, 1)}
        if eval_fn is not None and step % eval_every == 0:
            ev = eval_fn()
            model.train()
            rec = rec or {"step": step, "loss_ema": round(ema, 4), "elapsed_s": round(elapsed, 1)}
            rec["eval"] = round(ev, 4)
            tqdm.write(f"[{name}] step {step} train(ema) {ema:.4f} eval {ev:.4f}", file=sys.stdout)
            if ev < best[0]:
                best = (ev, copy.deepcopy(model.state_dict()), step)
        if rec:
            history.append(rec)
    bar.close()
    wall = time.time() - t0
    out = {"steps": step, "wall_s": round(wall, 1), "final_train_loss_ema": round(ema, 4)}
    if eval_fn is not None:
        ev = eval_fn()
        history.append({"step": step, "loss_ema": round(ema, 4), "elapsed_s": round(wall, 1), "eval": round(ev, 4)})
        if ev < best[0]:
            best = (ev, None, step)
        elif best[1] is not None:
            model.load_state_dict(best[1])
        out["kept_step"] = best[2]
        out["kept_eval"] = round(best[0], 4)
    model.eval()
    out["history"] = history
    return out


def pca_init_draft_embeddings(draft, target):
    """Draft embedding = target embedding projected onto its top principal
    directions (d_target -> d_draft), rescaled to the default init std."""
    with torch.no_grad():
        E = target.get_input_embeddings().weight.float()
        d = draft.config.hidden_size
        mu = E.mean(0, keepdim=True)
        _, _, Vh = torch.linalg.svd(E - mu, full_matrices=False)
        P = E @ Vh[:d].T
        P = P / P.std() * E.std()
        draft.get_input_embeddings().weight.copy_(P)


# ----------------------------------------------------------------------------
# cached distillation: the frozen target's outputs are computed once up front
# ----------------------------------------------------------------------------


def strided_windows(data: torch.Tensor, length: int, stride: int) -> torch.Tensor:
    """Windows of `length` tokens every `stride` tokens, plus one flush with the
    end, so every token of `data` is inside at least one window."""
    starts = list(range(0, len(data) - length + 1, stride))
    if starts[-1] != len(data) - length:
        starts.append(len(data) - length)
    return torch.stack([data[s : s + length] for s in starts])


@torch.no_grad()
def target_logprobs(target, windows: torch.Tensor, bs: int = 16) -> torch.Tensor:
    """Full next-token log-probs of the frozen target for every position of
    every window, stored as float16: [n_windows, length, vocab]."""
    target.eval()
    out = torch.empty(*windows.shape, VOCAB_SIZE, dtype=torch.float16)
    for i in range(0, len(windows), bs):
        out[i : i + bs] = F.log_softmax(target(windows[i : i + bs]).logits.float(), -1).to(torch.float16)
    return out


@torch.no_grad()
def target_generations(target, train_ids, *, n_windows, length, prompt_len, temps, bs, gen, eos_id):
    """The target's own continuations of random train-split prompts: each window
    is `prompt_len` corpus tokens + `length - prompt_len` target tokens.  Batches
    cycle through `temps` (0 = greedy, else pure sampling at that temperature,
    no top-k/top-p), which is the kind of text the draft sees at inference."""
    target.eval()
    outs = []
    for b, i in enumerate(range(0, n_windows, bs)):
        n = min(bs, n_windows - i)
        x = random_windows(train_ids, n, prompt_len, gen)
        t = temps[b % len(temps)]
        kw = dict(do_sample=False) if t == 0 else dict(do_sample=True, temperature=t, top_k=0, top_p=1.0)
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        y = target.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=length - prompt_len,
            min_new_tokens=length - prompt_len,
            pad_token_id=eos_id,
            **kw,
        )
        outs.append(y[:, :length])
    return torch.cat(outs)


@torch.no_grad()
def eval_distill_cached(draft, windows: torch.Tensor, t_lp: torch.Tensor, bs: int = 8):
    """Like eval_distill, with the target's log-probs precomputed."""
    draft.eval()
    kl_tot, agree, n_tok = 0.0, 0, 0
    for i in range(0, len(windows), bs):
        x = windows[i : i + bs]
        tl = t_lp[i : i + bs].float()
        dl = draft(x).logits.float()
        kl_tot += F.kl_div(F.log_softmax(dl, -1), tl, log_target=True, reduction="sum").item()
        agree += (tl.argmax(-1) == dl.argmax(-1)).sum().item()
        n_tok += x.numel()
    return kl_tot / n_tok, agree / n_tok


# ----------------------------------------------------------------------------
# measurement
# ----------------------------------------------------------------------------


@torch.no_grad()
def greedy_agreement(target, draft, prompts, new_tokens: int, eos_id: int):
    """Target greedy-decodes `new_tokens`; teacher-forced along that trajectory,
    record per-position whether argmax(draft) == argmax(target)."""
    matches = []
    for _, _, ids in prompts:
        x = torch.tensor([ids])
        # Greedy decode without eos stopping so every trajectory has the same length.
        out = target.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=eos_id,
        )
        seq = out[:, : len(ids) + new_tokens]
        tl = target(seq).logits
        dl = draft(seq).logits
        p = len(ids)
        # Position t predicts token t+1; the generated tokens are seq[p:], predicted at p-1 .. p+new-2.
        t_arg = tl[0, p - 1 : p - 1 + new_tokens].argmax(-1)
        d_arg = dl[0, p - 1 : p - 1 + new_tokens].argmax(-1)
        matches.append((t_arg == d_arg).tolist())
    return matches


def simulate_sd(matches: list[list[bool]], k: int):
    """Greedy speculative decoding along fixed trajectories: each step the draft
    proposes k tokens; the longest matching prefix m<=k is accepted and the
    target adds one token (correction on a mismatch, bonus if all k match).
    Returns (mean tokens emitted per target step, mean accepted draft tokens per step)."""
    steps = emitted = accepted = 0
    for m in matches:
        n = len(m)
        pos = 0
        while pos < n:
            a = 0
            while a < k and pos + a < n and m[pos + a]:
                a += 1
            adv = min(a + 1, n - pos)
            steps += 1
            emitted += adv
            accepted += a
            pos += adv
    return emitted / steps, accepted / steps


@torch.no_grad()
def samples(target, tok, prompts: list[str], new_tokens: int, seed: int):
    out = []
    for i, ptxt in enumerate(prompts):
        x = tok(ptxt, return_tensors="pt", add_special_tokens=False)
        g = target.generate(**x, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        torch.manual_seed(seed + i)
        s = target.generate(
            **x, max_new_tokens=new_tokens, do_sample=True, temperature=0.8, top_k=50, pad_token_id=tok.eos_token_id
        )
        out.append(
            {
                "prompt": ptxt,
                "greedy": tok.decode(g[0, x["input_ids"].size(1) :]),
                "sampled_t0.8_top50": tok.decode(s[0, x["input_ids"].size(1) :]),
            }
        )
    return out


# ----------------------------------------------------------------------------
# saving / report
# ----------------------------------------------------------------------------


def save_model(model, tok, path: Path, tok_from: Path | None = None):
    """Save `model` as fp16 safetensors plus the tokenizer.  With `tok_from`,
    the tokenizer files are copied byte-for-byte from that directory (so the
    two model dirs carry identical tokenizer files)."""
    import copy
    import shutil

    path.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.is_file():
            f.unlink()
    m = copy.deepcopy(model).to(torch.float16)
    m.generation_config.bos_token_id = tok.bos_token_id
    m.generation_config.eos_token_id = tok.eos_token_id
    m.generation_config.pad_token_id = tok.pad_token_id
    m.save_pretrained(path, safe_serialization=True)
    if tok_from is None:
        tok.save_pretrained(path)
    else:
        for f in tok_from.iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                shutil.copyfile(f, path / f.name)
    patch_saved_files(path)


def patch_saved_files(path: Path):
    """Make the saved files friendlier to loaders (idempotent).

    * config ``dtype``/``torch_dtype`` = float32: the models were trained in
      float32 and only *stored* as float16 to keep the repo small, so a plain
      ``from_pretrained(dir)`` (dtype="auto") should give float32 on CPU.
    * tokenizer_class = PreTrainedTokenizerFast: transformers 5 writes its
      internal "TokenizersBackend" name, which transformers 4.x cannot resolve;
      PreTrainedTokenizerFast is understood by both.
    """
    cfg_p = path / "config.json"
    cfg = json.loads(cfg_p.read_text())
    cfg["dtype"] = "float32"
    cfg["torch_dtype"] = "float32"
    cfg_p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tc_p = path / "tokenizer_config.json"
    tc = json.loads(tc_p.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_p.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def fmt_mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def write_readme(out_dir: Path, rep: dict):
    t, d, m = rep["target"], rep["draft"], rep["measurements"]
    lines = [
        "# Bundled tiny models",
        "",
        "A draft/target pair of tiny Llama-style causal LMs for exercising minedraft's",
        "speculative decoding on CPU, fully offline. Generated by `scripts/train/tiny_pair.py`",
        "(do not edit by hand; rerun the script). Both models share one tokenizer",
        "(identical files in both directories).",
        "",
        "```python",
        "import torch",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'tok = AutoTokenizer.from_pretrained("minedraft/models/tiny-target")',
        'target = AutoModelForCausalLM.from_pretrained("minedraft/models/tiny-target", dtype=torch.float32)',
        'draft = AutoModelForCausalLM.from_pretrained("minedraft/models/tiny-draft", dtype=torch.float32)',
        "```",
        "",
        "Weights are stored as float16 safetensors to keep the repo small; the models were",
        "trained in float32 and `config.json` says `dtype: float32`, so loading upcasts them",
        "(pass `dtype=torch.float32` explicitly to be safe). All numbers below were measured",
        "in float32 after the fp16 round-trip of the weights, i.e. on exactly what ships.",
        "",
        "## Data and tokenizer",
        "",
        f"* Corpus: `pydoc_data.topics.topics` (CPython's bundled doc pages), {rep['data']['n_pages']} pages,",
        f"  {rep['data']['total_chars']:,} characters; pages joined with `{EOS}` between them.",
        f"* Held-out eval split: {len(rep['data']['eval_pages'])} pages "
        f"({rep['data']['eval_char_frac'] * 100:.1f}% of characters, {rep['data']['eval_tokens']:,} tokens): "
        + ", ".join(f"`{p}`" for p in rep["data"]["eval_pages"])
        + ".",
        f"* Train split: {rep['data']['train_tokens']:,} tokens.",
        f"* Tokenizer: byte-level BPE (`tokenizers`), vocab {VOCAB_SIZE}, ByteLevel pre-tokenizer/decoder,",
        f"  `add_prefix_space=False`; `{EOS}` is bos = eos = pad (id {rep['data']['eos_id']}). No bos is added",
        "  automatically. Decoding round-trips arbitrary UTF-8.",
        "",
        "## Architecture",
        "",
        "| | tiny-target | tiny-draft |",
        "|---|---|---|",
        f"| layers | {t['config']['num_hidden_layers']} | {d['config']['num_hidden_layers']} |",
        f"| hidden / intermediate | {t['config']['hidden_size']} / {t['config']['intermediate_size']} | "
        f"{d['config']['hidden_size']} / {d['config']['intermediate_size']} |",
        f"| heads / kv heads | {t['config']['num_attention_heads']} / {t['config']['num_key_value_heads']} | "
        f"{d['config']['num_attention_heads']} / {d['config']['num_key_value_heads']} |",
        f"| parameters | {t['params']:,} | {d['params']:,} |",
        f"| files on disk | {fmt_mb(t['dir_bytes'])} | {fmt_mb(d['dir_bytes'])} |",
        f"| training | {t['train']['steps']} steps, {t['train']['wall_s'] / 60:.1f} min | "
        f"{d['train']['steps']} steps, {d['train']['wall_s'] / 60:.1f} min"
        + (f" (+ {d['train']['prep']['total_s'] / 60:.1f} min caching)" if "prep" in d["train"] else "")
        + " |",
        f"| eval CE loss (nats/token) | {t['eval_loss']:.3f} | {d['eval_loss']:.3f} |",
        "",
        f"Common: vocab {VOCAB_SIZE}, RoPE theta 10000, max positions 1024, tied embeddings, SiLU MLP, RMSNorm.",
        f"Uniform-guess loss would be ln({VOCAB_SIZE}) = {math.log(VOCAB_SIZE):.3f}.",
        "",
        "Training: target = next-token CE on random 256-token windows of the train split,",
        f"batch {rep['args']['batch']}, AdamW (betas 0.9/0.95, wd 0.1), lr {rep['args']['lr']} with linear warmup + cosine",
        "to 10%, grad-clip 1.0, stopped on a wall-clock budget. Draft = distillation from the frozen",
        f"target, loss KL(target || draft) + {rep['args']['draft_ce_weight']} * CE, lr {rep['args']['draft_lr']},"
        f" embeddings {'initialised from a PCA projection of the target embeddings' if rep['args']['draft_pca_init'] else 'randomly initialised'}.",
    ]
    if "prep" in d["train"]:
        pr = d["train"]["prep"]
        temps = ", ".join("greedy" if t == 0 else f"T={t:g}" for t in pr["gen_temps"])
        lines += [
            f"The target's full next-token distributions (fp16) were computed once, on {pr['corpus_windows']}"
            f" {rep['args']['seq_len']}-token windows of the train split (stride {pr['cache_stride']}, so every token is covered)",
            f"and on {pr['gen_windows']} windows of the target's own continuations of {pr['gen_prompt_len']}-token train-split"
            f" prompts (batches cycling {temps}; pure sampling, no top-k);",
            f"the draft trains on random batches of {rep['args']['draft_batch']} of those windows, so a step costs only the draft's"
            f" forward/backward (caching took {pr['total_s']:.0f} s, {pr['generate_s']:.0f} s of it generating).",
            "The weights with the lowest held-out KL are kept.",
        ]
    lines += [
        f"Training ran on {rep['args']['threads']} CPU threads (niced, on a shared machine); total wall time "
        f"{rep['total_wall_s'] / 60:.1f} min.",
    ]
    if "reused_target" in rep:
        r = rep["reused_target"]
        pc = r["previous_run_draft_config"]
        lines += [
            "The draft was retrained in a later invocation (`--reuse-target`, target loaded unchanged);",
            f"the previous draft ({pc['num_hidden_layers']} layer(s), hidden {pc['hidden_size']},"
            f" {r['previous_run_draft_params']:,} params; {r['previous_run_draft_train']['steps']} steps,"
            f" {r['previous_run_draft_train']['wall_s'] / 60:.1f} min) reached greedy agreement"
            f" {r['previous_run_greedy_agreement']:.3f}. The total above counts the target's training plus that",
            "invocation.",
        ]
    lines += [
        "",
        "## Draft/target agreement",
        "",
        f"* Teacher-forced argmax agreement on held-out text: **{d['eval_tf_agreement']:.3f}**;"
        f" KL(target || draft) = {d['eval_kl']:.3f} nats/token.",
        f"* Greedy agreement: {m['n_prompts']} held-out prompts ({m['prompt_len']} tokens each), the target greedy-decodes"
        f" {m['new_tokens']} tokens; teacher-forced along that trajectory the draft's argmax equals the",
        f"  target's at **{m['greedy_agreement']:.3f}** of positions. There are only"
        f" {len(rep['data']['eval_pages'])} held-out pages, so the",
        "  prompts are the first tokens of each held-out page plus evenly spaced paragraph starts inside",
        "  those pages (listed in `training_report.json`).",
        "* Expected tokens per speculative step under greedy SD (simulated along those trajectories:",
        "  accept the longest matching prefix of the k drafted tokens, plus one target token):",
        "",
    ]
    old_spec = rep.get("reused_target", {}).get("previous_run_speculative")
    if old_spec:
        lines += [
            "| k | tokens / step (incl. bonus) | accepted draft tokens / step | previous draft: tokens / step |",
            "|---|---|---|---|",
        ]
        for row, o in zip(m["speculative"], old_spec):
            lines.append(
                f"| {row['k']} | {row['tokens_per_step']:.3f} | {row['accepted_per_step']:.3f} | {o['tokens_per_step']:.3f} |"
            )
    else:
        lines += ["| k | tokens / step (incl. bonus) | accepted draft tokens / step |", "|---|---|---|"]
        for row in m["speculative"]:
            lines.append(f"| {row['k']} | {row['tokens_per_step']:.3f} | {row['accepted_per_step']:.3f} |")
    lines += [
        "",
        "## Caveats",
        "",
        "* The corpus is tiny (~120k training tokens) and the target is undertrained: its eval loss was",
        "  still falling when the time budget ran out. It writes doc-flavoured, locally plausible but",
        "  often nonsensical English (see below). That is all these models are for.",
        "* Both phases stop on wall-clock budgets, so the number of steps (and the exact weights) depends",
        "  on how busy the machine is; rerunning the script is deterministic only up to that.",
        "* The held-out split is chosen by characters (~5%), not by page count.",
    ]
    lines += ["", "## Target samples", ""]
    for s in m["samples"]:
        lines += [
            f"Prompt: `{s['prompt']!r}`",
            "",
            "Greedy:",
            "```",
            s["prompt"] + s["greedy"],
            "```",
            "Sampled (T=0.8, top-k 50):",
            "```",
            s["prompt"] + s["sampled_t0.8_top50"],
            "```",
            "",
        ]
    (out_dir / "README.md").write_text("\n".join(lines))


# ----------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=REPO_ROOT / "minedraft" / "models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-frac", type=float, default=0.05)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--target-minutes", type=float, default=12.0)
    ap.add_argument("--target-max-steps", type=int, default=100_000)
    ap.add_argument("--draft-minutes", type=float, default=10.0)
    ap.add_argument("--draft-max-steps", type=int, default=100_000)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--draft-batch", type=int, default=8)
    ap.add_argument("--draft-ce-weight", type=float, default=0.0)
    ap.add_argument("--no-draft-pca-init", dest="draft_pca_init", action="store_false")
    ap.add_argument(
        "--reuse-target",
        action="store_true",
        help="draft-only mode: load the already-saved target (and tokenizer) from --out-dir instead of "
        "retraining it; the target's files are only read.  The new draft replaces the saved one only if its "
        "greedy agreement beats the saved report's (see --force-save)",
    )
    ap.add_argument("--force-save", action="store_true", help="with --reuse-target, save the draft even if it is not better")
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--draft-hidden", type=int, default=128)
    ap.add_argument("--draft-inter", type=int, default=352)
    ap.add_argument("--draft-heads", type=int, default=4)
    ap.add_argument("--draft-kv-heads", type=int, default=2)
    ap.add_argument(
        "--cache-stride",
        type=int,
        default=128,
        help="the target's log-probs are cached once on seq-len windows of the train split taken every "
        "this many tokens (<= seq-len, so every token is covered); the draft then trains on those windows",
    )
    ap.add_argument(
        "--gen-windows",
        type=int,
        default=512,
        help="also distil on this many seq-len windows of the target's own continuations of train-split prompts",
    )
    ap.add_argument("--gen-prompt-len", type=int, default=32)
    ap.add_argument(
        "--gen-temps", type=str, default="0,0.8,1.0", help="generation batches cycle through these (0 = greedy)"
    )
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--draft-eval-every", type=int, default=200)
    ap.add_argument("--n-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    t_start = time.time()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    out_dir: Path = args.out_dir
    tdir, ddir = out_dir / "tiny-target", out_dir / "tiny-draft"
    pages = load_pages()
    train_names, eval_names = split_pages(pages, args.eval_frac, args.seed)
    total_chars = sum(len(v) for v in pages.values())
    eval_chars = sum(len(pages[n]) for n in eval_names)
    print(f"pages: {len(pages)} total, {len(eval_names)} held out ({eval_chars / total_chars:.1%} of chars): {eval_names}")

    # ---------------- tokenizer ----------------
    if args.reuse_target:
        tok = AutoTokenizer.from_pretrained(tdir)
    else:
        tok = train_tokenizer([pages[n] for n in train_names], VOCAB_SIZE)
    probe = "naïve café — 東京 ✓ def f(x):\n    return x**2"
    assert tok.decode(tok.encode(probe, add_special_tokens=False)) == probe, "tokenizer round-trip failed"
    train_ids = encode_pages(tok, train_names, pages)
    eval_ids = encode_pages(tok, eval_names, pages)
    print(
        f"tokenizer: vocab {len(tok)}, eos id {tok.eos_token_id}; train {len(train_ids):,} tokens, "
        f"eval {len(eval_ids):,} tokens ({total_chars / (len(train_ids) + len(eval_ids)):.2f} chars/token)"
    )
    ev_win = eval_windows(eval_ids, args.seq_len)
    gen = torch.Generator().manual_seed(args.seed)

    # ---------------- target ----------------
    tcfg = make_config(tok, hidden=256, inter=704, layers=6, heads=8, kv_heads=4)
    if args.reuse_target:
        target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32)
        prev = json.loads((out_dir / "training_report.json").read_text())
        t_train = prev["target"]["train"]
        print(f"reusing saved target from {tdir}")
    else:
        target = LlamaForCausalLM(tcfg)
        print(f"target params: {n_params(target):,}")

        def target_step():
            x = random_windows(train_ids, args.batch, args.seq_len, gen)
            return ce_loss(target(x).logits, x), {}

        t_train = train_loop(
            "target",
            target,
            target_step,
            lr=args.lr,
            warmup=args.warmup,
            minutes=args.target_minutes,
            max_steps=args.target_max_steps,
            wd=0.1,
            log_every=25,
            eval_fn=lambda: eval_ce(target, ev_win),
            eval_every=50,
        )
        # Round-trip through fp16 now so that everything measured below is what ships.
        target = target.to(torch.float16).to(torch.float32)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    t_eval = eval_ce(target, ev_win)
    print(f"target: {t_train['steps']} steps in {t_train['wall_s']:.0f}s, eval loss {t_eval:.4f}")

    # ---------------- draft ----------------
    # The target is frozen, so its outputs are computed once: full log-probs
    # (fp16) on strided corpus windows and on windows of its own generations.
    # Each draft step then costs only the draft's forward/backward.
    t_prep = time.time()
    corpus_win = strided_windows(train_ids, args.seq_len, args.cache_stride)
    gen_temps = [float(t) for t in args.gen_temps.split(",")] if args.gen_temps else [0.0]
    if args.gen_windows > 0:
        gen_win = target_generations(
            target,
            train_ids,
            n_windows=args.gen_windows,
            length=args.seq_len,
            prompt_len=args.gen_prompt_len,
            temps=gen_temps,
            bs=args.gen_batch,
            gen=gen,
            eos_id=tok.eos_token_id,
        )
    else:
        gen_win = torch.empty(0, args.seq_len, dtype=torch.long)
    gen_s = time.time() - t_prep
    pool = torch.cat([corpus_win, gen_win])
    pool_lp = target_logprobs(target, pool)
    ev_lp = target_logprobs(target, ev_win)
    prep_s = time.time() - t_prep
    prep = {
        "corpus_windows": len(corpus_win),
        "cache_stride": args.cache_stride,
        "gen_windows": len(gen_win),
        "gen_prompt_len": args.gen_prompt_len,
        "gen_temps": gen_temps,
        "cached_positions": pool.numel(),
        "cache_bytes": pool_lp.numel() * pool_lp.element_size(),
        "generate_s": round(gen_s, 1),
        "total_s": round(prep_s, 1),
    }
    print(
        f"cached target log-probs: {len(corpus_win)} corpus + {len(gen_win)} generated windows "
        f"({pool.numel():,} positions, {prep['cache_bytes'] / 1e9:.2f} GB) in {prep_s:.0f}s (generation {gen_s:.0f}s)"
    )

    dcfg = make_config(
        tok,
        hidden=args.draft_hidden,
        inter=args.draft_inter,
        layers=args.draft_layers,
        heads=args.draft_heads,
        kv_heads=args.draft_kv_heads,
    )
    torch.manual_seed(args.seed + 1)
    draft = LlamaForCausalLM(dcfg)
    if args.draft_pca_init:
        pca_init_draft_embeddings(draft, target)
    print(f"draft params: {n_params(draft):,}")

    def draft_step():
        idx = torch.randint(0, len(pool), (args.draft_batch,), generator=gen)
        x = pool[idx]
        tlp = pool_lp[idx].float()
        dl = draft(x).logits.float()
        dlp = F.log_softmax(dl, -1)
        kl = F.kl_div(dlp, tlp, log_target=True, reduction="sum") / x.numel()
        loss = kl
        if args.draft_ce_weight > 0:
            loss = loss + args.draft_ce_weight * ce_loss(dl, x)
        return loss, {}

    d_train = train_loop(
        "draft",
        draft,
        draft_step,
        lr=args.draft_lr,
        warmup=args.warmup,
        minutes=args.draft_minutes,
        max_steps=args.draft_max_steps,
        wd=0.05,
        log_every=50,
        eval_fn=lambda: eval_distill_cached(draft, ev_win, ev_lp)[0],
        eval_every=args.draft_eval_every,
    )
    d_train["prep"] = prep
    del pool_lp
    draft = draft.to(torch.float16).to(torch.float32)
    draft.eval()
    d_eval = eval_ce(draft, ev_win)
    d_kl, d_tf = eval_distill(draft, target, ev_win)
    print(f"draft: {d_train['steps']} steps in {d_train['wall_s']:.0f}s, eval loss {d_eval:.4f}, KL {d_kl:.4f}, tf-agree {d_tf:.3f}")

    # ---------------- measurements ----------------
    prompts = eval_prompts(tok, eval_names, pages, args.n_prompts, args.prompt_len)
    matches = greedy_agreement(target, draft, prompts, args.new_tokens, tok.eos_token_id)
    flat = [b for m in matches for b in m]
    g_agree = sum(flat) / len(flat)
    spec = []
    for k in range(1, 7):
        tps, aps = simulate_sd(matches, k)
        spec.append({"k": k, "tokens_per_step": round(tps, 4), "accepted_per_step": round(aps, 4)})
    print(f"greedy agreement over {len(flat)} positions: {g_agree:.3f}")
    for row in spec:
        print(f"  k={row['k']}: {row['tokens_per_step']:.3f} tokens/step ({row['accepted_per_step']:.3f} accepted)")
    sample_prompts = [
        'The "while" statement is used for',
        "A function definition defines",
        "Strings are immutable sequences of",
    ]
    if args.reuse_target:
        # Same target: keep its samples from the saved report (sampling on CPU threads
        # is not bit-reproducible, so regenerating could change them spuriously).
        smp = prev["measurements"]["samples"]
    else:
        smp = samples(target, tok, sample_prompts, 60, args.seed)
    for s in smp:
        print(f"--- {s['prompt']!r}\n[greedy] {s['greedy']!r}\n[sampled] {s['sampled_t0.8_top50']!r}")

    # ---------------- save ----------------
    if not args.reuse_target:
        save_model(target, tok, tdir)
    else:
        # Draft-only mode never writes into the target's directory.
        prev_agree = prev["measurements"]["greedy_agreement"]
        if g_agree <= prev_agree and not args.force_save:
            print(
                f"greedy agreement {g_agree:.4f} does not beat the saved draft's {prev_agree:.4f}; "
                f"leaving {ddir} and the report untouched (--force-save to override)"
            )
            return
    save_model(draft, tok, ddir, tok_from=tdir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        a, b = (tdir / f).read_bytes(), (ddir / f).read_bytes()
        assert a == b, f"{f} differs between model dirs"

    def cfg_summary(cfg):
        keys = ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"]
        return {k: getattr(cfg, k) for k in keys}

    rep = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out_dir"},
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "tokenizers": __import__("tokenizers").__version__, "python": sys.version.split()[0]},
        "data": {
            "n_pages": len(pages),
            "total_chars": total_chars,
            "eval_pages": eval_names,
            "eval_char_frac": round(eval_chars / total_chars, 4),
            "train_tokens": len(train_ids),
            "eval_tokens": len(eval_ids),
            "eos_id": tok.eos_token_id,
        },
        "target": {
            "config": cfg_summary(tcfg),
            "params": n_params(target),
            "dir_bytes": dir_size(tdir),
            "weights_bytes": (tdir / "model.safetensors").stat().st_size,
            "train": t_train,
            "eval_loss": round(t_eval, 4),
        },
        "draft": {
            "config": cfg_summary(dcfg),
            "params": n_params(draft),
            "dir_bytes": dir_size(ddir),
            "weights_bytes": (ddir / "model.safetensors").stat().st_size,
            "train": d_train,
            "eval_loss": round(d_eval, 4),
            "eval_kl": round(d_kl, 4),
            "eval_tf_agreement": round(d_tf, 4),
        },
        "measurements": {
            "n_prompts": len(prompts),
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "prompts": [{"page": n, "char_offset": off} for n, off, _ in prompts],
            "greedy_agreement": round(g_agree, 4),
            "speculative": spec,
            "samples": smp,
        },
        "total_wall_s": round(time.time() - t_start + (t_train["wall_s"] if args.reuse_target else 0), 1),
    }
    if args.reuse_target:
        rep["reused_target"] = {
            "note": "target (and tokenizer) loaded from a previous run; total_wall_s = that run's target "
            "training time + this run's wall time",
            "previous_run_total_wall_s": prev.get("total_wall_s"),
            "previous_run_draft_train": {k: v for k, v in prev["draft"]["train"].items() if k != "history"},
            "previous_run_greedy_agreement": prev["measurements"]["greedy_agreement"],
            "previous_run_draft_config": prev["draft"]["config"],
            "previous_run_draft_params": prev["draft"]["params"],
            "previous_run_speculative": prev["measurements"]["speculative"],
        }
    (out_dir / "training_report.json").write_text(json.dumps(rep, indent=2, ensure_ascii=False) + "\n")
    write_readme(out_dir, rep)
    print(f"saved {tdir} ({fmt_mb(rep['target']['dir_bytes'])}) and {ddir} ({fmt_mb(rep['draft']['dir_bytes'])})")
    print(f"total wall time {rep['total_wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
