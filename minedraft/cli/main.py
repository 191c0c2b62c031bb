"""The `minedraft` command: generate, serve, keygen, bench.

    minedraft generate "def fibonacci(n):" --max-tokens 64
    minedraft serve --bind tcp://127.0.0.1:5555
    minedraft keygen --out-dir keys
    minedraft bench ...            (arguments go to minedraft.bench.runner)

Heavy modules (torch, transformers, the engine) are imported only inside the subcommands that need them, so
`--help` is instant.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from ..config import DEFAULT_DRAFT, DEFAULT_TARGET, MODES, EngineConfig
from ..serving.zmq.protocol import DEFAULT_MAX_QUEUED_REPLIES  # one constant for the cli and the server
from .common import (PROG, _cores, _default, _engine_kw, _fail,
                     _Formatter, _fraction, _name_options, _positive_float, _positive_int, _quiet_libraries,
                     _run_async)
def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models and engine")
    g.add_argument("--target", default=DEFAULT_TARGET, metavar="DIR",
                   help="target model directory (weights + tokenizer; loaded from local files only), or a .gguf "
                        "file (run by llama.cpp) "
                        "(default: the tiny pair bundled with minedraft, %(default)s)")
    g.add_argument("--draft", default=None, metavar="DRAFT",
                   help="draft model directory (must share the target's tokenizer); or self:int4 / self:bf16: the "
                        "target's own weights, int4 weight-only or bfloat16, built at load; or 'suffix': drafts "
                        "from the prompt and earlier outputs, no draft model; or 'suffix+DRAFT' (with --model also "
                        "'suffix+model'): per request the suffix draft when it is promising, else the model's "
                        f"(default: the --model pair's default draft, else {DEFAULT_DRAFT})")
    g.add_argument("--hybrid-threshold", type=float, default=_default("hybrid_threshold"), metavar="S",
                   help="with --draft suffix+...: the suffix proposal's score (expected accepted tokens) from "
                        "which a request takes it instead of the model's draft")
    g.add_argument("--model", default=None, metavar="NAME",
                   help="a named pair instead of --target/--draft: 'tiny' (bundled) or a pulled one such as "
                        "smollm2-135m, which drafts with self:int4 unless --draft says otherwise (see "
                        "`minedraft models list`)")
    g.add_argument("--runner", choices=("auto", "torch", "llama.cpp"), default="auto",
                   help="what computes the target's forwards: torch (a model folder), llama.cpp (a .gguf file; with "
                        "a folder or --model, the .gguf it holds; needs pip install -e \".[gguf]\"), or auto: "
                        "llama.cpp for a .gguf --target, else torch")
    g.add_argument("--mode", choices=("auto",) + MODES, default=_default("mode"),
                   help="minedraft: draft one batch while verifying the other; sequential: standard "
                        "speculative decoding; autoregressive: target alone; auto (default): sequential for "
                        "--draft suffix (no draft model, nothing to overlap), else minedraft")
    g.add_argument("--k", type=int, default=_default("k"), metavar="K",
                   help="draft tokens per speculative step (1..16; ignored in autoregressive mode; default: 6 with "
                        "--draft suffix alone, else 4)")
    g.add_argument("--dynamic", "--adaptive-k", action=argparse.BooleanOptionalAction, dest="adaptive_k",
                   default=_default("adaptive_k"),
                   help="dynamic speculation (on by default): pick the draft budget per step (0..--k, 0 = plain "
                        "decoding) from measured draft/verify cost and acceptance, per batch size; --no-dynamic "
                        "drafts --k tokens every step")
    g.add_argument("--tetris", action="store_true", help="draft k + --tetris-extra tokens per request and verify "
                   "only the batch's --tetris-capacity most promising draft prefixes")
    g.add_argument("--tetris-capacity", type=_positive_int, default=None, metavar="C",
                   help="draft tokens verified per step with --tetris (default: k x requests in the batch)")
    g.add_argument("--tetris-extra", type=int, default=_default("tetris_extra"), metavar="E",
                   help="extra drafts per request Tetris may choose from (0..16)")
    g.add_argument("--max-prompt-tokens", type=_positive_int, default=None, metavar="N",
                   help="longest prompt accepted, in tokens (default: the target's context length, or what the "
                        "KV cache holds if less, minus the output limit)")
    g.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=_default("dtype"),
                   help="model weight and activation dtype")
    g.add_argument("--target-device", default=_default("target_device"), metavar="DEV",
                   help="'auto' (cuda:0 if available, else cpu), 'cpu' or 'cuda:N'")
    g.add_argument("--draft-device", default=_default("draft_device"), metavar="DEV",
                   help="'auto' (cuda:1 if there are two GPUs, else the target's), 'cpu' or 'cuda:N'")
    g.add_argument("--draft-cores", type=_cores, default=None, metavar="LIST",
                   help="CPU cores of the drafter, e.g. 0 or 0-1,4 (default: half of this process's cores in "
                        "minedraft mode, all of them in the others)")
    g.add_argument("--target-cores", type=_cores, default=None, metavar="LIST",
                   help="CPU cores of the verifier, e.g. 1-3 (default: the other half, with the odd core, in "
                        "minedraft mode; all of them in the others)")
    g.add_argument("--target-tp", type=_positive_int, default=_default("target_tp"), metavar="N",
                   help="tensor-parallel ranks of the target: N processes, one GPU (from --target-device on) "
                        "or share of --target-cores each")
    g.add_argument("--draft-tp", type=_positive_int, default=_default("draft_tp"), metavar="N",
                   help="tensor-parallel ranks of the draft")
    g.add_argument("--no-prefix-caching", action="store_false", dest="prefix_caching",
                   help="compute every prompt from scratch instead of sharing the KV blocks of a prefix already "
                        "computed (prefix caching is on by default)")


def _lazy(name: str):
    """A subcommand defined in cli/serve.py, imported when it runs."""
    def run(a) -> int:
        from . import serve as cli_serve
        return getattr(cli_serve, name)(a)
    return run


def _since_launch() -> float:
    """Seconds since this process started (imports included), as the user waited; since this module was
    imported where /proc is missing."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


class _Parser(argparse.ArgumentParser):
    """A bad option is one line, like the errors the commands raise themselves, not the whole usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, formatter_class=_Formatter,
                                description="Batch-parallel speculative decoding: draft one batch while verifying "
                                            "the other.")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    # generate -------------------------------------------------------------------------------------------------
    g = sub.add_parser("generate", formatter_class=_Formatter, help="stream one completion to the terminal",
                       description="Start the engine (drafter and verifier processes) on the given models, stream "
                                   "the completion of PROMPT to stdout as tokens are accepted, then print a "
                                   "one-line summary (tokens/s, acceptance rate) to stderr. A chat model answers "
                                   "PROMPT as a user message through its chat template unless --raw is given.\n\n"
                                   "Temperature 0 (the default) is greedy decoding; the output is then exactly "
                                   "what the target model alone would produce.")
    g.add_argument("prompt", help="the prompt text; '-' reads it from stdin")
    s = g.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=_positive_int, default=64, metavar="N", help="tokens to generate at most")
    s.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy; > 0 samples")
    s.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K likeliest tokens "
                   "(0 disables)")
    s.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass in (0, 1] "
                   "(1 disables)")
    s.add_argument("--seed", type=int, default=None, metavar="N", help="seed for sampling (default: a random "
                   "one); with a seed a sampled run is reproducible")
    s.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop when TEXT is generated "
                   "(repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    c = g.add_argument_group("chat", "A chat model (one whose chat template ends a turn with its end-of-sequence "
                             "token, e.g. smollm2-135m) gets PROMPT as a user message through its chat template by "
                             "default; other models (the bundled tiny pair) continue PROMPT as plain text.")
    c.add_argument("--chat", action="store_true", default=None,
                   help="send PROMPT through the chat template (with the assistant turn opened) even if the model "
                        "does not look like a chat model (default: on for chat models)")
    c.add_argument("--raw", action="store_false", dest="chat",
                   help="continue PROMPT as plain text, even on a chat model (no chat template; default: off)")
    c.add_argument("--system", default=None, metavar="TEXT", help="a system message before PROMPT (chat only)")
    _add_model_args(g)
    o = g.add_argument_group("output")
    o.add_argument("--no-stats", action="store_true", help="do not print the summary line to stderr")
    o.add_argument("--no-uvloop", action="store_true", help="use the stock asyncio loop instead of uvloop")
    g.set_defaults(func=cmd_generate)

    # serve ----------------------------------------------------------------------------------------------------
    v = sub.add_parser("serve", formatter_class=_Formatter,
                       help="serve requests over ZeroMQ (docs/PROTOCOL.md) and/or HTTP (OpenAI's API, --http)",
                       description="Run the engine behind a ZeroMQ ROUTER socket speaking the msgpack protocol of "
                                   "docs/PROTOCOL.md (clients: minedraft.client.Client, clients/node). Many "
                                   "clients, many concurrent requests each. Prints 'listening on ENDPOINT' to "
                                   "stdout once it serves; SIGINT/SIGTERM stop it cleanly.\n\n"
                                   "Only loopback addresses (and ipc://) are allowed unless --allow-remote is "
                                   "given. With --curve-secret-key, traffic is encrypted and clients must know "
                                   "the server's public key; add --curve-client-keys to also admit only known "
                                   "clients.\n\n"
                                   "With --http HOST:PORT it also (or, without --bind, only) serves the "
                                   "OpenAI-compatible HTTP API, /metrics and the dashboard at / on the same "
                                   "engine (README: HTTP API).")
    n = v.add_argument_group("network")
    n.add_argument("--bind", default=None, metavar="ENDPOINT",
                   help="ZeroMQ endpoint to bind, e.g. tcp://127.0.0.1:5555, tcp://127.0.0.1:* (a free port), "
                        "tcp://[::1]:5555 or ipc:///tmp/minedraft.sock (default: tcp://127.0.0.1:5555 unless "
                        "--http is given alone)")
    n.add_argument("--http", default=None, metavar="HOST:PORT",
                   help="also serve the OpenAI-compatible HTTP API, /metrics and the dashboard, e.g. "
                        "127.0.0.1:8000 (port 0: a free one)")
    n.add_argument("--api-key", default=None, metavar="KEY",
                   help="HTTP only: require 'Authorization: Bearer KEY' on /v1/* (default: the "
                        "MINEDRAFT_API_KEY environment variable if set, else no key)")
    n.add_argument("--model-name", default=None, metavar="NAME",
                   help="HTTP only: the model id clients send and /v1/models lists (default: --model's name "
                        "if given, else the target directory's name)")
    n.add_argument("--allow-remote", action="store_true",
                   help="allow binding a non-loopback address (0.0.0.0, *, a LAN address, an interface name), "
                        "for --bind and --http")
    n.add_argument("--curve-secret-key", metavar="FILE", default=None,
                   help="turn on CURVE encryption with this server secret key (z85, from `minedraft keygen`)")
    n.add_argument("--curve-public-key", metavar="FILE", default=None,
                   help="the server public key; optional (derived from the secret key), checked to match if given")
    n.add_argument("--curve-client-keys", metavar="PATH", default=None,
                   help="admit only clients whose CURVE public key is listed: a file with one z85 key per line, "
                        "or a directory of key files (default: any client that knows the server key)")
    n.add_argument("--max-message-bytes", type=_positive_int, default=None, metavar="N",
                   help="requests larger than this get a too_large error (HTTP: 413); ZeroMQ messages over 4x "
                        "this are dropped and their connection closed (default: sized to --max-prompt-tokens: "
                        "ZeroMQ 64 bytes per token + 64 KiB; HTTP's JSON 96 bytes per token + 64 KiB, at "
                        "least 1 MiB)")
    n.add_argument("--max-inflight-per-client", type=_positive_int, default=256, metavar="N",
                   help="requests one client may have running at once; beyond it: overloaded")
    n.add_argument("--max-queued-replies", type=_positive_int, default=DEFAULT_MAX_QUEUED_REPLIES, metavar="N",
                   help="unread replies the server holds for one client; a client past it is dropped (its "
                        "requests cancelled, its messages ignored for 10 s)")
    from ..serving.http.guard import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S,  # light: no uvicorn,
                                      DEFAULT_REFUSAL_RATE)                             # no engine
    n.add_argument("--http-header-timeout", type=_positive_float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                   help="HTTP only: a connection must send a request's complete headers within S seconds of "
                        "opening (or of its first byte after a keep-alive pause), else 408 and closed")
    n.add_argument("--http-body-timeout", type=_positive_float, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                   help="HTTP only: a request body must arrive within S seconds of its headers, else 408")
    n.add_argument("--http-max-connections", type=_positive_int, default=None, metavar="N",
                   help="HTTP only: open connections; at N a new one closes the oldest idle one, or gets a 503 "
                        "when all are busy (default: the open-file limit minus 128, at most 4096)")
    n.add_argument("--http-refusal-rate", type=_positive_float, default=DEFAULT_REFUSAL_RATE, metavar="R",
                   help="HTTP only: refusals (4xx replies) answered per second on average, bursts of R; past "
                        "that each waits its turn, so clients flooding bad requests cannot fill the event loop")
    _add_model_args(v)
    e = v.add_argument_group("capacity")
    e.add_argument("--max-tokens-limit", type=_positive_int, default=None, metavar="N",
                   help="the most max_tokens a request may ask for (default: half of the longest request the "
                        "model's context and the KV cache allow, at most 1024; also HTTP chat's default)")
    e.add_argument("--max-batch-size", type=_positive_int, default=_default("max_batch_size"), metavar="N",
                   help="requests decoded at once (split over the two batches)")
    e.add_argument("--kv-cache-tokens", type=_positive_int, default=None, metavar="N",
                   help="KV cache positions per model; admission waits while the cache is full (default: sized "
                        "by --kv-cache-memory-fraction, capped by what --max-batch-size requests can use; the "
                        "size chosen is logged at start)")
    e.add_argument("--kv-cache-memory-fraction", type=_fraction, default=_default("kv_cache_memory_fraction"),
                   metavar="F", help="share of the memory available at start that both workers' KV caches take "
                                     "together, when --kv-cache-tokens is not given")
    e.add_argument("--max-queue", type=_positive_int, default=_default("max_queue"), metavar="N",
                   help="requests waiting for admission; beyond it: overloaded")
    x = v.add_argument_group("process")
    x.add_argument("--stay-up-on-worker-death", action="store_true",
                   help="when a worker dies, keep serving (every request then gets engine_dead, HTTP 503) instead "
                        "of failing the requests in flight and exiting with status 3 for a supervisor to restart")
    x.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="log verbosity (stderr)")
    x.add_argument("--no-uvloop", action="store_true", help="use the stock asyncio loop instead of uvloop")
    v.set_defaults(func=_lazy("cmd_serve"))

    # keygen ---------------------------------------------------------------------------------------------------
    k = sub.add_parser("keygen", formatter_class=_Formatter, help="make a CURVE keypair for serve / clients",
                       description="Write a CURVE keypair made by zmq.curve_keypair(): DIR/NAME.secret (mode 0600, "
                                   "keep it private) and DIR/NAME.public, each one z85 line. Give the secret to "
                                   "`minedraft serve --curve-secret-key` and the public key to clients. For client "
                                   "keys (--curve-client-keys) make one pair per client.")
    k.add_argument("--out-dir", default=".", metavar="DIR", help="directory to write the two files into")
    k.add_argument("--name", default="server", help="file name stem")
    k.add_argument("--force", action="store_true", help="overwrite existing files")
    k.set_defaults(func=_lazy("cmd_keygen"))

    # models ---------------------------------------------------------------------------------------------------
    from .models import add_parser as add_models_parser
    add_models_parser(sub, _Formatter)

    # bench ----------------------------------------------------------------------------------------------------
    b = sub.add_parser("bench", add_help=False, help="benchmarks (all arguments go to minedraft.bench.runner; "
                       "`minedraft bench --help` for its options)",
                       description="Forwards every argument to minedraft.bench.runner.main(argv).")
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments for minedraft.bench.runner")
    b.set_defaults(func=cmd_bench)
    return p


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("minedraft")
    except Exception:
        return "unknown"


# -- generate ---------------------------------------------------------------------------------------------------
def _generate_config(a, prompt_tokens: int | None = None) -> EngineConfig:
    """One request's engine: its KV cache holds exactly that request (prompt_tokens, once known, else the longest
    prompt --max-prompt-tokens or the model allows) and no more."""
    kw = _engine_kw(a)
    if a.mode == "autoregressive":
        kw["k"] = _default("k")  # k is ignored in this mode, so any value is accepted
    elif a.k is not None and not 1 <= a.k <= 16:
        raise ValueError(f"--k must be in 1..16, got {a.k}")
    if prompt_tokens is not None:
        kw["max_prompt_tokens"] = prompt_tokens
    kw.update(max_tokens_limit=a.max_tokens, max_batch_size=1, max_queue=1)
    return EngineConfig(**kw)


def _prompt_limit(cfg: EngineConfig, given: int | None) -> str:
    if given is not None:
        return f"--max-prompt-tokens is {given}"
    ctx = f"the model's context {cfg.sizing.context}" if cfg.sizing and cfg.sizing.context else "the model's context"
    return (f"the limit is {cfg.max_prompt_tokens} (--max-prompt-tokens; by default {ctx}, or what the KV cache "
            f"holds, less --max-tokens {cfg.max_tokens_limit} and the drafts)")


def cmd_generate(a) -> int:
    prompt = sys.stdin.read() if a.prompt == "-" else a.prompt
    if a.system is not None and a.chat is False:
        return _fail("--system needs the chat template; it cannot go with --raw")
    if not prompt:
        return _fail("PROMPT is empty (give the text to continue, or '-' to read it from stdin)")
    from ..errors import MinedraftError
    from ..sampling_params import SamplingParams
    try:
        cfg = _generate_config(a)
        params = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, max_tokens=a.max_tokens,
                                seed=a.seed, stop=tuple(a.stop), ignore_eos=a.ignore_eos)
    except (ValueError, MinedraftError) as e:
        return _fail(_name_options(str(e)))
    if len(prompt) > 16 * cfg.max_prompt_tokens:  # the engine's cheap pre-tokenizer bound, checked up front
        return _fail(f"PROMPT is {len(prompt)} characters, over 16 per token: "
                     f"{_prompt_limit(cfg, a.max_prompt_tokens)}")
    _quiet_libraries()
    from ..engine.chat import chat_prompt_ids, is_chat_model
    from ..models.check import ModelDirError, check_pair
    try:  # before any worker starts: a bad directory answers in seconds, naming it
        tok, _, eos = check_pair(cfg.target, cfg.draft_model or cfg.target,
                                 need_draft=cfg.speculative and cfg.draft_model is not None)
    except ModelDirError as e:
        return _fail(str(e), 1)
    chat = a.chat if a.chat is not None else is_chat_model(tok, eos)
    if a.system is not None and not chat:
        return _fail("--system needs the chat template: this model does not look like a chat model; add --chat")
    msgs = ([{"role": "system", "content": a.system}] if a.system is not None else []) + \
        [{"role": "user", "content": prompt}]
    try:
        n_prompt = len(chat_prompt_ids(tok, msgs) if chat else tok.encode(prompt))
    except MinedraftError as e:
        return _fail(str(e), 1)
    if n_prompt > cfg.max_prompt_tokens:
        return _fail(f"PROMPT has {n_prompt} tokens{' with the chat template' if chat else ''}; "
                     f"{_prompt_limit(cfg, a.max_prompt_tokens)}")
    if a.max_prompt_tokens is None:
        cfg = _generate_config(a, n_prompt)  # a KV cache for this prompt, not the longest one the model allows

    async def run():
        from ..engine.engine import Engine
        t0 = time.perf_counter()
        async with Engine(cfg) as engine:
            t_start = time.perf_counter() - t0
            final = None
            if chat:
                deltas = engine.stream_chat(msgs, params)
            else:
                deltas = engine.stream(prompt, params)
            first = None
            async for d in deltas:
                if d.text:
                    sys.stdout.write(d.text)
                    sys.stdout.flush()
                    if first is None:
                        first = _since_launch()
                if d.finished:
                    final = d
            sys.stdout.write("\n")
            sys.stdout.flush()
            return final, t_start, first, engine.stats()

    try:
        final, t_start, first, est = _run_async(run(), not a.no_uvloop)
    except (ValueError, MinedraftError) as e:
        return _fail(str(e), 1)
    except Exception as e:  # e.g. a model directory that transformers cannot load
        return _fail(f"{type(e).__name__}: {e}", 1)
    if not a.no_stats and final is not None and final.stats is not None:
        st = final.stats
        tps = st.output_tokens / st.latency_s if st.latency_s > 0 else 0.0
        acc = (f"acceptance {100 * st.acceptance_rate:.1f}% ({st.accepted_tokens}/{st.draft_tokens} drafts), "
               f"{st.mean_accepted_length:.2f} tokens/step, " if cfg.speculative else "")
        extras = "".join(f", {x}" for x, on in (("dynamic", cfg.adaptive_k), ("tetris", cfg.tetris)) if on)
        shown = f"first text {first:.1f} s after launch, " if first is not None else ""
        print(f"[{PROG}] {st.output_tokens} tokens in {st.latency_s:.2f} s ({tps:.1f} tokens/s), {acc}"
              f"{shown}engine start {t_start:.1f} s, ttft once started {1000 * st.ttft_s:.0f} ms, finish "
              f"{final.finish_reason}; mode {cfg.mode}, k {cfg.draft_k}{extras}",
              file=sys.stderr)
    return 0


# -- bench ------------------------------------------------------------------------------------------------------
def cmd_bench(a) -> int:
    return _bench(a.args)


def _bench(argv: list[str]) -> int:
    try:
        from ..bench import runner as bench
    except ImportError as e:
        return _fail(f"bench is unavailable: cannot import minedraft.bench.runner ({e})", 1)
    rc = bench.main(list(argv))
    return rc if isinstance(rc, int) else 0


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C at any moment (imports, engine start-up, streaming) ends with one line and exit status 130; the
    workers never see it (they are spawned with SIGINT blocked) and are stopped by the engine's shutdown."""
    from ..cores import prefer_passive_wait
    prefer_passive_wait()  # before torch loads: the bench's in-process baselines and LocalEngine run here
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        if argv and argv[0] == "bench":  # everything after it belongs to bench, --help included
            return _bench(argv[1:])
        a = build_parser().parse_args(argv)
        return a.func(a)
    except KeyboardInterrupt:
        with contextlib.suppress(Exception):
            if sys.stdout.isatty():
                sys.stdout.write("\n")  # do not leave the line on a half-streamed completion
            sys.stdout.flush()
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        return 130


def entry() -> None:
    """The console script: main(), then exit without the interpreter's teardown. Everything that matters (workers,
    shared memory, sockets) was released by main(); with torch and transformers loaded the teardown alone takes
    about 3 s, which `serve` would add to every SIGTERM and `generate` to every run."""
    rc = main()
    import logging
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    entry()
