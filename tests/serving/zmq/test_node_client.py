"""The Node.js client (clients/node) against a real `minedraft serve` subprocess.

Its greedy generate, stream and cancel must give exactly what the Python API gives for the same requests: the
Python client on the same server, and the target model alone in process (LocalEngine).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minedraft.config import EngineConfig
from minedraft.engine.local_engine import LocalEngine

NODE_DIR = Path(__file__).resolve().parents[3] / "clients" / "node"
MAX_TOKENS_LIMIT = 200
PROMPTS = ["def fibonacci(n):", "The class statement"]

pytestmark = pytest.mark.skipif(not (shutil.which("node") and shutil.which("npm")),
                                reason="node and npm are not installed (the Node.js client needs both)")


def _env() -> dict:
    return {**os.environ, "PYTHONIOENCODING": "utf-8", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def node_modules():
    if not (NODE_DIR / "node_modules" / "zeromq").is_dir() or not (NODE_DIR / "node_modules" / "@msgpack").is_dir():
        r = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, f"npm ci failed:\n{r.stdout}\n{r.stderr}"
    return NODE_DIR / "node_modules"


@pytest.fixture(scope="module")
def endpoint(tiny_pair, node_modules):
    """`python -m minedraft.cli.main serve` on a free loopback port (the server reports the one it bound)."""
    cmd = [sys.executable, "-m", "minedraft", "serve", "--bind", "tcp://127.0.0.1:*",
           "--target", tiny_pair.target, "--draft", tiny_pair.draft, "--k", "3", "--max-prompt-tokens", "64",
           "--max-tokens-limit", str(MAX_TOKENS_LIMIT), "--kv-cache-tokens", "8192", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), text=True)
    try:
        line = proc.stdout.readline()  # blocks until the server is serving (or it died)
        assert line.startswith("listening on "), f"server did not start: {line!r}\n{proc.stderr.read()}"
        yield line.split()[2]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read()


@pytest.fixture(scope="module")
def reference(tiny_pair):
    ref = LocalEngine(EngineConfig(target=tiny_pair.target, draft=tiny_pair.draft, mode="autoregressive",
                                   max_prompt_tokens=64, max_tokens_limit=MAX_TOKENS_LIMIT, kv_cache_tokens=8192))
    cache = {}

    def run(prompt, n):
        if (prompt, n) not in cache:
            cache[(prompt, n)] = ref.generate([prompt], {"max_tokens": n, "ignore_eos": True})[0]
        return cache[(prompt, n)]
    return run


def python_client(endpoint, fn):
    """Run fn(client) on a fresh asyncio loop with the Python client."""
    import asyncio

    from minedraft.client import Client

    async def go():
        async with Client(endpoint, timeout=30) as c:
            return await fn(c)
    return asyncio.run(go())


def node(endpoint, *args, check=True) -> list:
    r = subprocess.run(["node", str(NODE_DIR / "client.mjs"), "--endpoint", endpoint, "--timeout-ms", "30000",
                        *args], capture_output=True, text=True, timeout=60)
    if check:
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def test_generate(endpoint, reference):
    for prompt in PROMPTS:
        [out] = node(endpoint, "generate", prompt, "--max-tokens", "24", "--ignore-eos")
        py = python_client(endpoint, lambda c: c.generate(prompt, {"max_tokens": 24, "ignore_eos": True}))
        ref = reference(prompt, 24)
        assert out["token_ids"] == py.token_ids == ref.token_ids
        assert out["text"] == py.text == ref.text
        assert out["finish_reason"] == py.finish_reason == "length"
        assert out["stats"]["output_tokens"] == 24


def test_generate_with_token_ids_prompt(endpoint, reference, tiny_tokenizer):
    ids = tiny_tokenizer.encode(PROMPTS[0])
    [out] = node(endpoint, "generate", json.dumps(ids), "--token-ids", "--max-tokens", "16", "--ignore-eos")
    assert out["token_ids"] == reference(PROMPTS[0], 16).token_ids


def test_stream(endpoint, reference):
    prompt = PROMPTS[1]
    lines = node(endpoint, "stream", prompt, "--max-tokens", "30", "--ignore-eos")
    deltas = [m for m in lines if m["type"] == "delta"]
    done = [m for m in lines if m["type"] == "done"]
    summary = lines[-1]

    async def py_stream(c):
        return [d async for d in c.stream(prompt, {"max_tokens": 30, "ignore_eos": True})]
    py = python_client(endpoint, py_stream)
    ref = reference(prompt, 30)
    assert len(deltas) > 2 and len(done) == 1 and done[0]["finish_reason"] == "length"
    assert "".join(d["text"] for d in deltas) == "".join(d.text for d in py) == ref.text
    assert [t for d in deltas for t in d["token_ids"]] == [t for d in py for t in d.token_ids] == ref.token_ids
    assert summary["type"] == "summary" and summary["text"] == ref.text and summary["token_ids"] == ref.token_ids


@pytest.mark.parametrize("after", ["1", "0"])
def test_cancel(endpoint, reference, after):
    prompt = PROMPTS[0]
    [out] = node(endpoint, "cancel-demo", prompt, "--max-tokens", str(MAX_TOKENS_LIMIT), "--ignore-eos",
                 "--after", after)
    full = reference(prompt, MAX_TOKENS_LIMIT).token_ids
    assert out["cancelled"] is True and out["finish_reason"] == "abort"
    assert len(out["token_ids"]) < MAX_TOKENS_LIMIT and out["token_ids"] == full[:len(out["token_ids"])]
    assert out["deltas"] >= int(after)



def test_python_client_cancel_ends_the_same_way(endpoint, reference):
    got, reason = python_client(endpoint, _cancel_after_first(PROMPTS[0]))
    full = reference(PROMPTS[0], MAX_TOKENS_LIMIT).token_ids
    assert reason == "abort" and 0 < len(got) < MAX_TOKENS_LIMIT and got == full[:len(got)]


def _cancel_after_first(prompt):
    async def run(c):
        got, cancelled = [], False
        async for d in c.stream(prompt, {"max_tokens": MAX_TOKENS_LIMIT, "ignore_eos": True}, request_id="c"):
            if d.finished:
                return got, d.finish_reason
            got.extend(d.token_ids)
            if got and not cancelled:
                cancelled = True
                await c.cancel("c")
        return got, None
    return run


def test_errors_and_health(endpoint):
    [out] = node(endpoint, "generate", "x", "--max-tokens", str(MAX_TOKENS_LIMIT + 1), check=False)
    assert out["error"]["code"] == "invalid_request" and "limit" in out["error"]["message"]
    [h] = node(endpoint, "health")
    assert h["ok"] is True
    [s] = node(endpoint, "stats")
    assert s["server"]["requests"] >= 1 and "acceptance_rate" in s


def test_no_reply_without_server(node_modules):
    """A client pointed at nothing times out cleanly (exit code 1, a JSON error)."""
    t = time.monotonic()
    r = subprocess.run(["node", str(NODE_DIR / "client.mjs"), "--endpoint", "tcp://127.0.0.1:1", "--timeout-ms",
                        "300", "health"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "timeout"
    assert time.monotonic() - t < 10


class _StubEngine:
    """Enough of an Engine for a protocol-level check, without models."""

    async def generate(self, prompt, params, request_id=None):
        from minedraft.outputs import GenerationResult
        return GenerationResult(request_id, f"echo:{prompt}", [1, 2, 3], "length")

    async def abort(self, request_id):
        return False

    def health(self):
        return {"ok": True, "drafter_alive": True, "verifier_alive": True, "error": None}

    def stats(self):
        return {}


@pytest.fixture
def curve_stub_server(tmp_path):
    """A CURVE-enabled Server on a stub engine, on its own loop in a thread."""
    import asyncio
    import threading

    from minedraft.serving.zmq.server import Server
    from minedraft.serving.zmq.access import write_keypair
    write_keypair(tmp_path / "s.secret", tmp_path / "s.public")
    started, box = threading.Event(), {}

    def run():
        async def main():
            async with Server(_StubEngine(), "tcp://127.0.0.1:*", curve_secret_key=tmp_path / "s.secret") as s:
                box["endpoint"], box["stop"], box["loop"] = s.endpoint, asyncio.Event(), asyncio.get_running_loop()
                started.set()
                await box["stop"].wait()
        asyncio.run(main())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(10)
    yield box["endpoint"], tmp_path / "s.public"
    box["loop"].call_soon_threadsafe(box["stop"].set)
    t.join(10)


def test_curve_with_server_key(curve_stub_server, node_modules):
    ep, public = curve_stub_server
    [out] = node(ep, "--server-key", str(public), "generate", "hi")
    assert out["text"] == "echo:hi" and out["token_ids"] == [1, 2, 3]
    [out] = node(ep, "--server-key", public.read_text().strip(), "health")  # the key inline
    assert out["ok"] is True
    # No key: the handshake never completes. Short deadlines can expire while the send itself still waits; the
    # client must still answer with a timeout error, not die of an unhandled rejection.
    for ms, cmd in itertools.product(("500", "1", "2", "3", "5"), (["health"], ["generate", "hi"])):
        r = subprocess.run(["node", str(NODE_DIR / "client.mjs"), "--endpoint", ep, "--timeout-ms", ms, *cmd],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and r.stdout, (ms, cmd, r.stderr)
        assert json.loads(r.stdout)["error"]["code"] == "timeout"
