"""llama.cpp as a measured peer: llama-server against minedraft on the same weights, prompts and batch.

    PYTHONPATH=$PWD python scripts/bench/llama_peer.py --model smollm2-135m --batch 1 4 --repeats 3

Rows, per workload (the bench's open-chat and grounded prompts, chat template applied, sent as token ids so every
row reads the same tokens) and batch size B (B requests in flight: llama-server with B slots and continuous
batching; minedraft with max_batch_size B):
  server F32 / server Q4_1        llama-server on the float32 GGUF of the weights / the model's own Q4_1 GGUF
  server ... ngram-*              the same with its n-gram speculation (--spec-type; --spec picks the modes)
  minedraft ar / suffix           minedraft's engine, torch runner, float32 folder: target alone / suffix drafts
  gguf F32|Q4_1 ar / suffix       minedraft's engine with the llama.cpp runner on the same GGUFs (issue 42)
Greedy, --max-tokens tokens per request (end-of-sequence ignored), one thread each: llama-server `-t 1 -tb 1`,
minedraft one core per worker (drafter core 0, verifier core 1) and MINEDRAFT_WORKER_THREADS=1. Repeats are the
outer loop and the row order reverses every other repeat (a shared box drifts); figures are medians; the ratios
come last. "same" is the share of requests whose tokens equal: for a speculative row, the same runner alone (server
plain, minedraft ar, gguf ... ar); for the llama.cpp runner alone (gguf ... ar), llama-server's plain run.

llama-server: --server-bin, else $MINEDRAFT_LLAMA_BIN (a folder), else the cached build (~/.cache/minedraft/llama.cpp/
bin, /root/llama/build/bin); absent, the script says so and exits 0. The F32 GGUF is made once with llama-quantize
(--allow-requantize ... F32) under ~/.cache/minedraft/gguf/. Not part of CI (it needs a llama.cpp build).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minedraft"
BIN_DIRS = [CACHE / "llama.cpp" / "bin", Path("/root/llama/build/bin"), Path("/root/llama/build/vendor/llama.cpp/bin")]


def find_bin(name: str, explicit: str | None) -> str | None:
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    dirs = ([Path(os.environ["MINEDRAFT_LLAMA_BIN"])] if os.environ.get("MINEDRAFT_LLAMA_BIN") else []) + BIN_DIRS
    for d in dirs:
        if os.access(d / name, os.X_OK):
            return str(d / name)
    return shutil.which(name)


def ggufs(model_dir: str, quantize: str | None) -> dict[str, str]:
    """{'Q4_1': the model's own GGUF (models pull keeps it in the folder), 'F32': the same weights in float32}."""
    own = sorted(Path(model_dir).glob("*.gguf"))
    if not own:
        sys.exit(f"no .gguf in {model_dir}: run `minedraft models pull smollm2-135m` (it keeps the GGUF)")
    out = {"Q4_1": str(own[0])}
    f32 = CACHE / "gguf" / (own[0].stem.rsplit(".", 1)[0] + ".F32.gguf")
    if not f32.exists():
        if quantize is None:
            sys.exit("llama-quantize not found (it makes the F32 GGUF); pass --quantize-bin")
        f32.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([quantize, "--allow-requantize", str(own[0]), str(f32) + ".part", "F32"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.replace(str(f32) + ".part", f32)
    out["F32"] = str(f32)
    return out


class Server:
    """llama-server on one GGUF: B slots, one thread, greedy requests of token ids through /completion."""

    def __init__(self, binary: str, gguf: str, slots: int, ctx_per_slot: int, spec: str | None, core: int | None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [binary, "-m", gguf, "-t", "1", "-tb", "1", "-np", str(slots), "-c", str(slots * ctx_per_slot),
               "--host", "127.0.0.1", "--port", str(self.port)]
        if spec:
            cmd += ["--spec-type", spec]
        if core is not None:
            cmd = ["taskset", "-c", str(core)] + cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise RuntimeError("llama-server did not become healthy in 120 s")

    def complete(self, ids: list[int], max_tokens: int) -> list[int]:
        body = json.dumps({"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True,
                           "cache_prompt": False, "return_tokens": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())["tokens"]

    def run(self, prompts, slots: int, max_tokens: int) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(slots) as pool:
            outs = list(pool.map(lambda p: self.complete(p, max_tokens), prompts))
        return sum(map(len, outs)) / (time.perf_counter() - t0), outs

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def engine_run(target: str, draft: str, mode: str, prompts, warm, B: int, max_tokens: int):
    from minedraft import Engine, EngineConfig, SamplingParams
    from minedraft.bench.runner import run_workload
    cfg = EngineConfig(target=target, draft=draft, mode=mode, max_batch_size=B, kv_cache_tokens=8192,
                       max_tokens_limit=max_tokens, max_prompt_tokens=1024, draft_cores=[0], target_cores=[1])
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async with Engine(cfg) as engine:
        await run_workload(engine, warm, params, None)
        m, outs = await run_workload(engine, prompts, params, None)
    return m["tok_s"], outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="smollm2-135m", help="a pulled model (minedraft models pull NAME)")
    ap.add_argument("--server-bin", default=None)
    ap.add_argument("--quantize-bin", default=None)
    ap.add_argument("--workload", nargs="+", choices=("chat", "grounded"), default=["chat", "grounded"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--waves", type=int, default=2, help="requests per run = B x waves")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spec", nargs="*", default=["ngram-map-k"],
                    help="llama-server --spec-type modes to run beside its plain decoding")
    ap.add_argument("--quants", nargs="+", default=["F32", "Q4_1"])
    ap.add_argument("--rows", nargs="+", default=["server", "minedraft", "gguf"],
                    help="row families: server (llama-server), minedraft (torch runner), gguf (llama.cpp runner)")
    a = ap.parse_args()
    server_bin = find_bin("llama-server", a.server_bin)
    if server_bin is None and "server" in a.rows:
        print("llama-server not found (--server-bin, $MINEDRAFT_LLAMA_BIN, or a cached build): skipped")
        return 0
    os.environ.setdefault("MINEDRAFT_WORKER_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from minedraft.bench.runner import chat_prompts, grounded
    from minedraft.models.hub import resolve_model
    from transformers import AutoTokenizer
    folder = resolve_model(a.model)[0]
    files = ggufs(folder, find_bin("llama-quantize", a.quantize_bin))
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    make = {"chat": chat_prompts, "grounded": grounded}
    rows: list[tuple] = []  # (label, kind, args)
    for q in a.quants if "server" in a.rows else []:
        for spec in [None] + list(a.spec):
            rows.append((f"server {q}" + (f" {spec}" if spec else ""), "server", (files[q], spec)))
    if "minedraft" in a.rows:
        rows += [("minedraft ar", "engine", (folder, "suffix", "autoregressive")),
                 ("minedraft suffix", "engine", (folder, "suffix", "sequential"))]
    for q in a.quants if "gguf" in a.rows else []:
        rows += [(f"gguf {q} ar", "engine", (files[q], "suffix", "autoregressive")),
                 (f"gguf {q} suffix", "engine", (files[q], "suffix", "sequential"))]
    results: dict[tuple, list] = {}
    print(f"llama-server: {server_bin}\nGGUFs: {files}", flush=True)
    for rep in range(a.repeats):
        for wl in a.workload:
            for B in a.batch:
                n = B * a.waves
                pool = make[wl](tok, n * (a.repeats + 1), 0)
                prompts, warm = pool[rep * n:(rep + 1) * n], pool[a.repeats * n:a.repeats * n + B]
                for label, kind, args in (rows if rep % 2 == 0 else rows[::-1]):
                    if kind == "server":
                        srv = Server(server_bin, args[0], B, max(map(len, prompts)) + a.max_tokens + 64, args[1], 1)
                        try:
                            srv.run(warm, B, 8)
                            tps, outs = srv.run(prompts, B, a.max_tokens)
                        finally:
                            srv.close()
                    else:
                        tps, outs = asyncio.run(engine_run(*args, prompts, warm, B, a.max_tokens))
                    results.setdefault((wl, B, label), []).append((tps, outs))
                    print(f"  rep {rep} {wl} B={B} {label}: {tps:.1f} tok/s", flush=True)
        if rep < a.repeats - 1:
            report(results, a)  # so far: a run cut short still leaves its medians
    report(results, a)
    return 0


def report(results, a) -> None:
    print(f"\n{'workload':<9} {'B':>2}  {'row':<28} {'tok/s':>7} {'same':>5}")
    med = {}
    for (wl, B, label), runs in results.items():
        med[(wl, B, label)] = statistics.median(t for t, _ in runs)
        kind, rest = label.split()[0], label.split()[1:]
        # a speculative row against its own runner alone; the llama.cpp runner alone against llama-server alone
        ref_label = {"server": f"server {rest[0]}", "minedraft": "minedraft ar",
                     "gguf": f"gguf {rest[0]} ar" if rest[-1] != "ar" else f"server {rest[0]}"}[kind]
        ref = results.get((wl, B, ref_label)) if ref_label != label else None
        same = ""
        if ref:
            pairs = [(o, r) for (_, outs), (_, routs) in zip(runs, ref) for o, r in zip(outs, routs)]
            same = f"{sum(o == r for o, r in pairs) / len(pairs):.2f}"
        print(f"{wl:<9} {B:>2}  {label:<28} {med[(wl, B, label)]:>7.1f} {same:>5}")
    print("\nratios (medians; a shared box: read these, not the tok/s)")
    for wl in a.workload:
        for B in a.batch:
            def best(prefix):
                xs = [(v, k[2]) for k, v in med.items() if k[:2] == (wl, B) and k[2].startswith(prefix)]
                return max(xs) if xs else None
            pairs = [("minedraft ar", "server F32"), ("gguf F32 ar", "server F32"), ("gguf Q4_1 ar", "server Q4_1"),
                     ("gguf F32 suffix", "server F32"), ("gguf Q4_1 suffix", "server Q4_1")]
            for mine, theirs in pairs:
                m, t = med.get((wl, B, mine)), best(theirs)
                if m and t:
                    print(f"{wl:<9} B={B:<2} {mine:<17} / best {theirs} ({t[1]}): {m / t[0]:.2f}x")
            m, t = best("minedraft"), best("server")
            if m and t:
                print(f"{wl:<9} B={B:<2} minedraft's best ({m[1]}) / llama.cpp's best ({t[1]}): {m[0] / t[0]:.2f}x")
            m = best("gguf")
            if m and t:
                print(f"{wl:<9} B={B:<2} llama.cpp runner's best ({m[1]}) / llama.cpp's best ({t[1]}): "
                      f"{m[0] / t[0]:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
