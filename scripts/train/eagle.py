"""Train a feature-conditioned draft (EAGLE-style) for a target: one decoder layer that reads, at each position, the
target's final-norm hidden state of the position before (its "feature") together with the token, and guesses the
target's feature there; the target's own LM head (frozen, optionally cut to a reduced vocabulary) turns the guess
into draft logits. minedraft runs it through ModelRunner (model_runner.load_feature_fc) and the Drafter feeds it the
verifier's features after each verdict (drafting/drafter.py).

Data: sequences with the target's features at every position, made by the target itself:
  --data smollm2   shards from `scripts/train/smollm2_draft.py gen --features` (chat prompts, greedy answers)
  --data tiny      the bundled tiny target's greedy continuations of prompts cut from its training corpus

Phases (each resumable; --work holds the data, the checkpoint and the log):
  tiny-data  (tiny only) make the sequences
  train      pass 1 feeds the target's features, pass 2 feeds the draft's own guesses from pass 1 (as drafting
             k > 1 tokens does); loss per pass: KL(target || draft) over the head's vocabulary + smooth-L1 on the
             feature; checkpoints every --ckpt-every steps and on a wall-clock budget (--minutes)
  export     fp16 weights + config (+ draft_vocab.json) + eagle_fc.safetensors into --export-dir

    python scripts/train/smollm2_draft.py gen --features --gen-dtype float32 --work out/eagle-smollm2
    python scripts/train/eagle.py train --data smollm2 --work out/eagle-smollm2 --minutes 30
    python scripts/train/eagle.py export --data smollm2 --work out/eagle-smollm2
    python scripts/train/smollm2_draft.py eval --export-dir minedraft/models/smollm2-135m-eagle
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
TINY_TARGET = ROOT / "minedraft" / "models" / "tiny-target"
EXPORTS = {"smollm2": ROOT / "minedraft" / "models" / "smollm2-135m-eagle",
           "tiny": ROOT / "minedraft" / "models" / "tiny-eagle"}
SMOLLM2_VOCAB = ROOT / "minedraft" / "models" / "smollm2-135m-draft" / "draft_vocab.json"


def target_path(args) -> str:
    if args.target:
        return args.target
    if args.data == "tiny":
        return str(TINY_TARGET)
    from minedraft.models.hub import pair_dirs
    return str(pair_dirs("smollm2-135m")[0])


def load_target(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def vocab_subset(args) -> list[int] | None:
    """The draft head's tokens: the real pair reuses the token-only draft's 8,192 (99.7% of the target's answers);
    the tiny target's 2,048-token vocabulary is kept whole."""
    if args.data == "smollm2":
        return json.load(open(SMOLLM2_VOCAB))["token_ids"]
    return None


# -- data ------------------------------------------------------------------------------------------------------
def phase_tiny_data(args):
    """Greedy continuations by the tiny target of prompts cut from its own training text, with its features."""
    from transformers import AutoTokenizer

    from minedraft.models.distill import greedy_rows
    from minedraft.runner.model_runner import ModelRunner
    import pydoc_data.topics as topics
    out = Path(args.work) / "gen"
    out.mkdir(parents=True, exist_ok=True)
    tdir = target_path(args)
    tok = AutoTokenizer.from_pretrained(tdir, local_files_only=True)
    text = "".join(v for k, v in sorted(topics.topics.items()))
    ids = tok(text)["input_ids"]
    rng = random.Random(0)
    starts = [rng.randrange(0, len(ids) - 64) for _ in range(args.num_prompts)]
    prompts = [ids[s:s + rng.randint(8, 48)] for s in starts]
    B = 64
    runner = ModelRunner.from_pretrained(tdir, B * (args.max_new + 64), 16)
    for s in range(0, len(prompts), B):
        path = out / f"shard_{s // B:05d}.pt"
        if not path.exists():
            torch.save(greedy_rows(runner, prompts[s:s + B], args.max_new, eos=None, features=True), path)
    print(f"tiny-data: {len(prompts)} sequences in {out}")


def load_rows(work) -> list[dict]:
    rows = []
    for p in sorted((Path(work) / "gen").glob("shard_*.pt")):
        rows += [r for r in torch.load(p) if "feat" in r]
    return rows


def make_examples(rows, tmap):
    """(draft input ids [L], target features [L, H]) per sequence: position j reads token j and feature j - 1 and
    is trained to give feature j; the last token (never fed) is left out."""
    ex = []
    for r in rows:
        seq = (r["prompt"] + r["gen"])[:-1]
        feat = r["feat"]
        assert feat.shape[0] == len(seq), (feat.shape, len(seq))
        ids = torch.tensor(seq)
        ex.append((tmap[ids] if tmap is not None else ids, feat))
    return ex


# -- model -----------------------------------------------------------------------------------------------------
def build_eagle(target, token_ids: list[int] | None):
    """One decoder layer at the target's width (started from the target's last layer), the target's final norm,
    its embedding rows (frozen, tied to the head; a reduced vocabulary adds one 'other' input row), and fc."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tc = target.config
    V = len(token_ids) + 1 if token_ids is not None else tc.vocab_size
    cfg = LlamaConfig(vocab_size=V, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                      num_hidden_layers=1, num_attention_heads=tc.num_attention_heads,
                      num_key_value_heads=tc.num_key_value_heads,
                      head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
                      max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
                      rope_parameters=dict(tc.rope_parameters), tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    draft = LlamaForCausalLM(cfg)
    H = tc.hidden_size
    fc = torch.nn.Linear(2 * H, H, bias=False)
    with torch.no_grad():
        E = target.model.embed_tokens.weight
        if token_ids is None:
            draft.model.embed_tokens.weight.copy_(E)
        else:
            draft.model.embed_tokens.weight[:-1] = E[torch.tensor(token_ids)]
            draft.model.embed_tokens.weight[-1] = E.mean(0)
        draft.model.layers[0].load_state_dict(target.model.layers[-1].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        fc.weight.zero_()  # starts as "embedding + feature": the layer sees both at the scale it was trained on
        fc.weight[:, :H] = torch.eye(H)
        fc.weight[:, H:] = torch.eye(H)
    draft.tie_weights()
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft, fc


def run(draft, fc, ids, feats_in, att):
    """Final-norm states [B, L, H] and head logits [B, L, V-without-'other'] (what ModelRunner computes)."""
    x = fc(torch.cat([feats_in, draft.model.embed_tokens(ids)], -1))
    h = draft.model(inputs_embeds=x, attention_mask=att).last_hidden_state
    return h, draft.lm_head(h)


def batch_loss(draft, fc, batch, reduced: bool, reg_w: float):
    B, L = len(batch), max(e[0].shape[0] for e in batch)
    H = batch[0][1].shape[1]
    ids = torch.zeros(B, L, dtype=torch.long)
    feat = torch.zeros(B, L, H)
    att = torch.zeros(B, L, dtype=torch.long)
    for i, (x, f) in enumerate(batch):
        n = x.shape[0]
        ids[i, :n], feat[i, :n], att[i, :n] = x, f.float(), 1
    mask = att.bool()
    with torch.no_grad():  # the target's own distribution over the head's vocabulary, from its true features
        p_logits = draft.lm_head(feat)
        if reduced:
            p_logits = p_logits[..., :-1]
        logp = torch.log_softmax(p_logits, -1)
        label = logp.argmax(-1)
    prev = torch.cat([torch.zeros(B, 1, H), feat[:, :-1]], 1)
    losses, agrees = 0.0, []
    for _ in range(2):  # pass 1: true features; pass 2: the draft's guesses of them (the state deeper drafts see)
        h, logits = run(draft, fc, ids, prev, att)
        if reduced:
            logits = logits[..., :-1]
        logq = torch.log_softmax(logits, -1)
        kl = (logp.exp() * (logp - logq)).sum(-1)[mask].mean()
        reg = F.smooth_l1_loss(h[mask], feat[mask])
        losses = losses + kl + reg_w * reg
        agrees.append(float((logq.argmax(-1) == label)[mask].float().mean()))
        prev = torch.cat([torch.zeros(B, 1, H), h[:, :-1].detach()], 1)
    return losses, agrees


def phase_train(args):
    from tqdm import tqdm
    torch.manual_seed(0)
    target = load_target(target_path(args))
    token_ids = vocab_subset(args)
    tmap = None
    if token_ids is not None:
        tmap = torch.full((target.config.vocab_size,), len(token_ids), dtype=torch.long)
        tmap[torch.tensor(token_ids)] = torch.arange(len(token_ids))
    draft, fc = build_eagle(target, token_ids)
    del target
    rows = load_rows(args.work)
    random.Random(0).shuffle(rows)
    n_val = max(8, len(rows) // 40)
    val, train = make_examples(rows[:n_val], tmap), make_examples(rows[n_val:], tmap)
    print(f"train: {len(train)} sequences ({sum(e[0].shape[0] for e in train)} positions), {len(val)} held out",
          file=sys.stderr)
    params = [p for p in list(draft.parameters()) + list(fc.parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    steps_per_epoch = math.ceil(len(train) / args.batch)
    total = steps_per_epoch * args.epochs
    ckpt = Path(args.work) / "eagle.pt"
    step, spent = 0, 0.0
    if ckpt.exists():
        st = torch.load(ckpt)
        draft.load_state_dict(st["model"])
        fc.load_state_dict(st["fc"])
        opt.load_state_dict(st["opt"])
        step, spent = st["step"], st.get("spent_s", 0.0)
        print(f"train: resumed at step {step}/{total}", file=sys.stderr)
    sched = lambda s: min(1.0, (s + 1) / 30) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))  # noqa
    log = open(Path(args.work) / "eagle_log.jsonl", "a")

    def save(val_agree):
        torch.save({"model": draft.state_dict(), "fc": fc.state_dict(), "opt": opt.state_dict(), "step": step,
                    "spent_s": spent, "val_agree": val_agree}, ckpt)

    draft.train()
    bar = tqdm(total=total, initial=step, desc="train", unit="step")
    t_start = time.time() - spent
    while step < total:
        epoch, pos = divmod(step, steps_per_epoch)
        order = list(range(len(train)))
        random.Random(epoch).shuffle(order)
        batch = [train[i] for i in order[pos * args.batch:(pos + 1) * args.batch]]
        for g in opt.param_groups:
            g["lr"] = args.lr * sched(step)
        loss, agree = batch_loss(draft, fc, batch, token_ids is not None, args.reg)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        spent = time.time() - t_start
        bar.update()
        bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{agree[0]:.3f}/{agree[1]:.3f}")
        out_of_time = args.minutes and spent > args.minutes * 60
        if step % args.ckpt_every == 0 or step == total or out_of_time:
            draft.eval()
            with torch.no_grad():
                vs = [batch_loss(draft, fc, val[i:i + args.batch], token_ids is not None, args.reg)[1]
                      for i in range(0, len(val), args.batch)]
            draft.train()
            va = [sum(v[j] for v in vs) / len(vs) for j in range(2)]
            tqdm.write(f"step {step}: held-out top-1 agreement, true features {va[0]:.4f}, own guesses {va[1]:.4f}")
            log.write(json.dumps({"step": step, "spent_s": round(spent), "val_agree": va,
                                  "train_agree": agree}) + "\n")
            log.flush()
            save(va)
        if out_of_time:
            print("train: time budget spent; rerun to continue", file=sys.stderr)
            break


# -- export ----------------------------------------------------------------------------------------------------
def phase_export(args):
    from safetensors.torch import save_file

    from minedraft.runner.model_files import FEATURE_FILE
    tdir = target_path(args)
    target = load_target(tdir)
    token_ids = vocab_subset(args)
    draft, fc = build_eagle(target, token_ids)
    st = torch.load(Path(args.work) / "eagle.pt")
    draft.load_state_dict(st["model"])
    fc.load_state_dict(st["fc"])
    out = Path(args.export_dir or EXPORTS[args.data])
    out.mkdir(parents=True, exist_ok=True)
    draft.config.dtype = "float16"
    draft.half().save_pretrained(out, safe_serialization=True)
    save_file({"weight": fc.weight.detach().half().contiguous()}, str(out / FEATURE_FILE))
    if token_ids is not None:
        json.dump({"target_vocab_size": target.config.vocab_size, "token_ids": token_ids},
                  open(out / "draft_vocab.json", "w"))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):  # the bundled pair ships its
        if args.data == "tiny" and (Path(tdir) / f).exists():                          # tokenizer in both folders
            (out / f).write_bytes((Path(tdir) / f).read_bytes())
    print(f"exported to {out} (step {st['step']}, held-out top-1 agreement {st['val_agree']})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["tiny-data", "train", "export"])
    ap.add_argument("--data", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--target", default=None, help="target folder (default: by --data)")
    ap.add_argument("--work", default=None, help="default: out/eagle-<data>")
    ap.add_argument("--export-dir", default=None, help="default: minedraft/models/<smollm2-135m|tiny>-eagle")
    ap.add_argument("--num-prompts", type=int, default=1024, help="tiny-data")
    ap.add_argument("--max-new", type=int, default=96, help="tiny-data")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--reg", type=float, default=1.0, help="weight of the feature regression")
    ap.add_argument("--minutes", type=float, default=0,
                    help="train: stop (checkpointed) once all runs together have trained this long (a rerun "
                         "continues the count: raise it to go on)")
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    args.work = args.work or str(ROOT / "out" / f"eagle-{args.data}")
    if args.threads:
        torch.set_num_threads(args.threads)
    {"tiny-data": phase_tiny_data, "train": phase_train, "export": phase_export}[args.phase](args)


if __name__ == "__main__":
    main()
