#!/usr/bin/env python
"""Where one forward step of the target goes, per part, beside the memory floor.

    python scripts/bench/runner_profile.py [--target DIR] [--batches 1 2 4 8] [--tokens 1 2 5 8] [--context 64]

One process, one thread. The torch path (ModelRunner(kernels=False), the runner before the C kernels) and the
kernel path (runner/kernel_forward.py) load the same weights and are timed alternately, call by call, at each
(B rows, n scored tokens per row) over a cached context; medians of --repeats. For each it prints the step's
total and its parts:

* torch path: projections (q/k/v/o Linears), attention (scaled_dot_product_attention), MLP (gate/up/down and the
  activation), norms (RMSNorm modules), LM head, measured by timing those modules' calls in separate profiled
  calls; kernel path: the C library's own counters (kernels.c, md_profile), the head and final norm timed from
  Python;
* sampling: a softmax and an argmax over the step's logits (what a sampler does at least once per logit row);
* other: the rest of the step (Python, planning, cache bookkeeping, embedding, copies).

Times are this thread's CPU time (time.thread_time, and the kernels' counters likewise) unless --clock wall:
on a box shared with other work, time spent waiting for a core is not the runner's. Memory stalls still count.

The floor is the step's weight bytes (each parameter read once; the embedding counted once when it is also the
head) over this thread's read bandwidth, measured here by summing a 512 MiB tensor (and copying one, shown for
reference). A loaded box gives noisy absolute figures: compare the two paths, which alternate.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from minedraft.config import DEFAULT_TARGET
from minedraft.runner.model_runner import ModelRunner, load_causal_lm

clock = time.thread_time  # --clock wall: time.perf_counter

PARTS = ["projections", "attention", "MLP", "norms", "LM head", "sampling", "other"]
C_PARTS = {0: "norms", 1: "projections", 2: "attention", 3: "attention", 4: "MLP", 5: "MLP"}  # kernels.c TICK ids


def bandwidth(mib: int = 512, repeats: int = 5) -> tuple[float, float]:
    """One thread's (read, copy) bandwidth in bytes/s: best of `repeats` sums / copies of a mib MiB tensor."""
    a = torch.ones(mib * 2**18)
    b = torch.empty_like(a)
    reads, copies = [], []
    for _ in range(repeats):
        t = clock()
        a.sum()
        reads.append(clock() - t)
        t = clock()
        b.copy_(a)
        copies.append(clock() - t)
    n = a.numel() * 4
    return n / min(reads), 2 * n / min(copies)


def step_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def prime(runner, B: int, context: int, room: int) -> None:
    for r in range(B):
        runner.cache.allocate(r, context + room)
    runner.forward(list(range(B)), [[5 + r % 7] * context for r in range(B)], 1)


def step(runner, B: int, n: int, context: int) -> tuple[float, torch.Tensor]:
    t = clock()
    logits = runner.forward(list(range(B)), [[7] * n for _ in range(B)], n)
    dt = clock() - t
    for r in range(B):
        runner.cache.truncate(r, context)
    return dt, logits


def sampling_time(logits: torch.Tensor) -> float:
    t = clock()
    flat = logits.reshape(-1, logits.shape[-1])
    torch.softmax(flat, -1)
    flat.argmax(-1)
    return clock() - t


class TorchParts:
    """Times the torch path's modules by wrapping their forward calls (only while `on`)."""

    def __init__(self, runner):
        self.t = defaultdict(float)
        self.on = False
        for layer in runner.layers:
            a = layer.self_attn
            for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
                self._wrap(m, "projections")
            self._wrap(layer.mlp, "MLP")
            self._wrap(layer.input_layernorm, "norms")
            self._wrap(layer.post_attention_layernorm, "norms")
        self._wrap(runner.norm, "norms")
        self._wrap(runner.lm_head, "LM head")
        sdpa = F.scaled_dot_product_attention

        def timed_sdpa(*args, **kw):
            t = clock()
            out = sdpa(*args, **kw)
            if self.on:
                self.t["attention"] += clock() - t
            return out
        F.scaled_dot_product_attention = timed_sdpa

    def _wrap(self, module, part):
        inner = module.forward

        def forward(*args, **kw):
            t = clock()
            out = inner(*args, **kw)
            if self.on:
                self.t[part] += clock() - t
            return out
        module.forward = forward


class KernelParts:
    """The kernel path's parts: kernels.c's counters, the head and final norm timed around their calls."""

    def __init__(self, runner):
        self.k = runner.kernels
        self.t = defaultdict(float)
        self.on = False
        for name, part in (("matmul", "LM head"), ("rmsnorm", "norms")):
            inner = getattr(self.k, name)

            def call(*args, _inner=inner, _part=part, **kw):
                t = clock()
                out = _inner(*args, **kw)
                if self.on:
                    self.t[_part] += clock() - t
                return out
            setattr(self.k, name, call)

    def start(self):
        self.k.lib.md_profile(1)
        c = self.k.lib.md_profile_times()
        for i in range(8):
            c[i] = 0.0
        self.on = True

    def stop(self):
        self.on = False
        self.k.lib.md_profile(0)
        c = self.k.lib.md_profile_times()
        for i, part in C_PARTS.items():
            self.t[part] += c[i]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 5, 8])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--paths", nargs="+", default=["torch", "kernels"], choices=["torch", "kernels"])
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="this thread's CPU time (default; a shared box's other work does not count) or wall time")
    a = ap.parse_args(argv)
    global clock
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    read_bw, copy_bw = bandwidth()
    model = load_causal_lm(a.target)
    nbytes = step_bytes(model)
    floor = nbytes / read_bw
    print(f"weights read per step: {nbytes / 1e6:.1f} MB; one-thread bandwidth: sum {read_bw / 1e9:.2f} GB/s, "
          f"copy {copy_bw / 1e9:.2f} GB/s; floor {floor * 1e3:.1f} ms per step ({1 / floor:.1f} steps/s)")
    room = max(a.tokens) + 1
    runners, parts = {}, {}
    for name in a.paths:
        r = ModelRunner(model, max(a.batches) * (a.context + room + 16) + 64, 16, kernels=name == "kernels")
        if name == "kernels" and r.kernels is None:
            raise SystemExit("the kernels did not load (see the warning above)")
        prime(r, max(a.batches), a.context, room)
        runners[name] = r
        parts[name] = (KernelParts if name == "kernels" else TorchParts)(r)
    print(f"\nms per step ({a.clock} time), median of {a.repeats} (alternating paths); parts from separate "
          f"profiled calls; floor {floor * 1e3:.1f} ms")
    print(f"{'path':8s} {'B':>2s} {'n':>2s} {'total':>7s} {'x floor':>7s} " + " ".join(f"{p:>11s}" for p in PARTS))
    for B in a.batches:
        for n in a.tokens:
            totals = {name: [] for name in runners}
            for _ in range(a.repeats + 1):
                for name, r in runners.items():
                    totals[name].append(step(r, B, n, a.context)[0])
            for name, r in runners.items():
                p = parts[name]
                p.t.clear()
                sampled = []
                for _ in range(a.repeats):
                    p.start() if hasattr(p, "start") else setattr(p, "on", True)
                    dt, logits = step(r, B, n, a.context)
                    p.stop() if hasattr(p, "stop") else setattr(p, "on", False)
                    sampled.append(sampling_time(logits))
                total = statistics.median(totals[name][1:])
                row = {k: v / a.repeats for k, v in p.t.items()}
                row["sampling"] = statistics.median(sampled)
                row["other"] = max(0.0, total - sum(v for k, v in row.items() if k != "sampling"))
                print(f"{name:8s} {B:2d} {n:2d} {total * 1e3:7.2f} {total / floor:7.2f} "
                      + " ".join(f"{row.get(k, 0.0) * 1e3:11.2f}" for k in PARTS), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
