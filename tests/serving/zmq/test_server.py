"""The ZeroMQ front end and the Python client: protocol conformance, isolation between clients, bad input, CURVE.

One Engine serves the whole module (several Server front ends share it). Replies are checked against the same
Engine's own output for the same greedy request.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import msgpack
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from minedraft.serving.zmq import protocol as P
from minedraft.client import Client
from minedraft.config import EngineConfig
from minedraft.engine.engine import Engine
from minedraft.errors import EngineDeadError, InvalidRequestError, OverloadedError
from minedraft.outputs import GenerationResult, RequestStats
from minedraft.serving.zmq.server import Server
from minedraft.serving.zmq.access import BindError, check_bind, is_loopback_endpoint, load_key, write_keypair

# Every async test runs on the module's loop, so they share one Engine; sync tests need no loop.
amod = pytest.mark.asyncio(loop_scope="module")

# long enough that a request of this many tokens is still running when a test acts on it (disconnect, abort):
# the kernel runner finishes 128 tokens of the tiny pair in a fraction of a second
MAX_TOKENS_LIMIT = 1024
MAX_PROMPT = 64
MSG_LIMIT = 64 * 1024
REPLY_TIMEOUT = 15.0
PROMPTS = ["def fibonacci(n):", "The class statement", "while True: yield", "import os"]


def greedy(n: int) -> dict:
    return {"max_tokens": n, "ignore_eos": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_pair):
    cfg = EngineConfig(target=tiny_pair.target, draft=tiny_pair.draft, k=3, max_prompt_tokens=MAX_PROMPT,
                       max_tokens_limit=MAX_TOKENS_LIMIT, kv_cache_tokens=16384, max_batch_size=16)
    async with Engine(cfg) as e:
        yield e


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(engine):
    async with Server(engine, "tcp://127.0.0.1:*", max_message_bytes=MSG_LIMIT) as s:
        yield s


@pytest_asyncio.fixture(loop_scope="module")
async def client(server):
    async with Client(server.endpoint, timeout=REPLY_TIMEOUT) as c:
        yield c


_ref_cache: dict = {}


async def reference(engine, prompt, n: int) -> GenerationResult:
    key = (tuple(prompt) if isinstance(prompt, list) else prompt, n)
    if key not in _ref_cache:
        _ref_cache[key] = await engine.generate(prompt, greedy(n))
    return _ref_cache[key]


class Raw:
    """A bare DEALER speaking bytes, for the malformed-input cases."""

    def __init__(self, endpoint: str, **curve):
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for k, v in curve.items():
            setattr(self.sock, k, v)
        self.sock.connect(endpoint)

    async def send(self, data: bytes | dict) -> None:
        await self.sock.send(data if isinstance(data, bytes) else msgpack.packb(data))

    async def recv(self, timeout: float = REPLY_TIMEOUT) -> dict:
        if not await self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("no reply")
        return msgpack.unpackb(await self.sock.recv())

    async def ask(self, data, timeout: float = REPLY_TIMEOUT) -> dict:
        await self.send(data)
        return await self.recv(timeout)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def raw(server):
    r = Raw(server.endpoint)
    yield r
    r.close()


async def assert_serves(server, engine, prompt="The class statement", n=8):
    """A fresh client still gets exactly the engine's output."""
    async with Client(server.endpoint, timeout=REPLY_TIMEOUT) as c:
        r = await c.generate(prompt, greedy(n))
    ref = await reference(engine, prompt, n)
    assert (r.token_ids, r.text, r.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)


# -- the happy path ---------------------------------------------------------------------------------------------
@amod
async def test_generate_equals_engine(engine, client):
    for prompt in PROMPTS:
        r = await client.generate(prompt, greedy(24))
        ref = await reference(engine, prompt, 24)
        assert r.token_ids == ref.token_ids and len(r.token_ids) == 24
        assert r.text == ref.text and r.finish_reason == ref.finish_reason == "length"
        assert r.stats.output_tokens == 24 and r.stats.prompt_tokens == ref.stats.prompt_tokens
    ids = engine.tokenizer.encode(PROMPTS[0])
    r = await client.generate(ids, greedy(24))  # prompt as token ids
    assert r.token_ids == (await reference(engine, PROMPTS[0], 24)).token_ids


@amod
async def test_stream_equals_engine(engine, client):
    for prompt in PROMPTS[:2]:
        deltas = [d async for d in client.stream(prompt, greedy(30))]
        ref = await reference(engine, prompt, 30)
        assert "".join(d.text for d in deltas) == ref.text
        assert [t for d in deltas for t in d.token_ids] == ref.token_ids
        assert not any(d.finished for d in deltas[:-1])
        last = deltas[-1]
        assert last.finished and last.finish_reason == "length" and last.stats.output_tokens == 30
        assert len(deltas) > 2  # really streamed, not one lump


@amod
async def test_params_as_sampling_params_and_sampled_seed(engine, client):
    from minedraft.sampling_params import SamplingParams
    sp = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    a = await client.generate("import os", sp)
    b = await engine.generate("import os", sp)
    assert a.token_ids == b.token_ids


@amod
async def test_cancel_stream_midway(engine, client):
    ref = await reference(engine, PROMPTS[0], MAX_TOKENS_LIMIT)
    got, final, cancelled = [], None, False
    async for d in client.stream(PROMPTS[0], greedy(MAX_TOKENS_LIMIT), request_id="s1"):
        if d.finished:
            final = d
            break
        got.extend(d.token_ids)
        if got and not cancelled:
            cancelled = True
            await client.cancel("s1")
            # cancel returns only once the stream's final message has arrived
            assert client._requests["s1"].qsize() >= 1
    assert final is not None and final.finish_reason == "abort"
    assert 1 <= len(got) < MAX_TOKENS_LIMIT and got == ref.token_ids[:len(got)]
    assert final.stats.output_tokens >= len(got)


@amod
async def test_cancel_generate(engine, client):
    ref = await reference(engine, PROMPTS[1], MAX_TOKENS_LIMIT)
    task = asyncio.ensure_future(client.generate(PROMPTS[1], greedy(MAX_TOKENS_LIMIT), request_id="g1"))
    await asyncio.sleep(0)  # the generate message goes out first
    await client.cancel("g1")
    r = await task
    assert r.finish_reason == "abort" and len(r.token_ids) < MAX_TOKENS_LIMIT
    assert r.token_ids == ref.token_ids[:len(r.token_ids)]
    # the id is free again at once, and the engine holds nothing for it
    r2 = await client.generate(PROMPTS[1], greedy(8), request_id="g1")
    assert r2.token_ids == ref.token_ids[:8]
    assert engine.stats()["running"] == 0


@amod
async def test_breaking_out_of_a_stream_cancels_it(engine, client, server):
    before = engine.stats()["aborted"]
    async for _ in client.stream(PROMPTS[2], greedy(MAX_TOKENS_LIMIT), request_id="b1"):
        break
    deadline = time.monotonic() + 5
    while engine.stats()["aborted"] == before and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert engine.stats()["aborted"] == before + 1
    # the id stays reserved until the server's final message for it, then is reusable
    while "b1" in client._requests and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    r = await client.generate(PROMPTS[2], greedy(4), request_id="b1")
    assert r.finish_reason == "length"


@amod
async def test_cancel_unknown_and_finished_ids(client):
    with pytest.raises(P.UnknownRequestError) as ei:
        await client.cancel("never-sent")
    assert ei.value.code == "unknown_request"
    await client.generate("import os", greedy(2), request_id="fin")
    with pytest.raises(P.UnknownRequestError):
        await client.cancel("fin")


@amod
async def test_health_and_stats(engine, client):
    h = await client.health()
    assert h == {"ok": True, "drafter_alive": True, "verifier_alive": True, "error": None}
    s = await client.stats()
    for key in ("mode", "k", "steps", "output_tokens", "acceptance_rate", "kv_blocks_free", "running"):
        assert key in s
    assert s["server"]["max_message_bytes"] == MSG_LIMIT and s["server"]["requests"] >= 1
    assert set(s["server"]["errors"]) == set(P.ERROR_CODES)  # every code, 0 when none was sent
    assert s["output_tokens"] <= engine.stats()["output_tokens"]


@amod
async def test_two_clients_same_ids_concurrently(engine, server):
    n = 20
    async with Client(server.endpoint, timeout=REPLY_TIMEOUT) as a, \
            Client(server.endpoint, timeout=REPLY_TIMEOUT) as b:
        async def streamed(c, prompt, rid):
            return [t async for d in c.stream(prompt, greedy(n), request_id=rid) for t in d.token_ids]

        results = await asyncio.gather(
            a.generate(PROMPTS[0], greedy(n), request_id="1"), b.generate(PROMPTS[1], greedy(n), request_id="1"),
            streamed(a, PROMPTS[2], "2"), streamed(b, PROMPTS[3], "2"),
            *(a.generate(p, greedy(n)) for p in PROMPTS), *(b.generate(p, greedy(n)) for p in PROMPTS))
    refs = [(await reference(engine, p, n)).token_ids for p in PROMPTS]
    assert results[0].token_ids == refs[0] and results[1].token_ids == refs[1]
    assert results[2] == refs[2] and results[3] == refs[3]
    assert [r.token_ids for r in results[4:8]] == refs and [r.token_ids for r in results[8:]] == refs


# -- bad input --------------------------------------------------------------------------------------------------
def _req(t="generate", **kw):
    base = {"v": 1, "t": t, "id": "x"}
    if t in ("generate", "stream"):
        base.update(prompt="import os", params=greedy(4))
    base.update(kw)
    return base


BAD = {
    "malformed msgpack": (b"\xc1\x00\x01", "bad_message", None),
    "truncated msgpack": (msgpack.packb(_req())[:-3], "bad_message", "x"),  # id read before the cut
    "trailing bytes": (msgpack.packb(_req()) + b"\x01", "bad_message", "x"),
    "empty frame": (b"", "bad_message", None),
    "not a map (array)": (msgpack.packb([1, 2, 3]), "bad_message", None),
    "not a map (string)": (msgpack.packb("generate"), "bad_message", None),
    "non-string keys": (msgpack.packb({1: 2, "t": "generate"}), "bad_message", None),
    "bin keys": (msgpack.packb({b"v": 1, "t": "health", "id": "x"}, use_bin_type=True), "bad_message", "x"),
    "bin key in params": (msgpack.packb(_req(params={b"max_tokens": 2}), use_bin_type=True), "bad_message", "x"),
    "invalid utf-8": (b"\x81\xa1t\xa2\xff\xfe", "bad_message", None),
    "no type": (_req(t=None), "bad_message", "x"),
    "type not a string": (_req(t=5), "bad_message", "x"),
    "unknown type": (_req(t="frobnicate"), "unknown_type", "x"),
    "wrong version": (_req(v=2), "unsupported_version", "x"),
    "version a float": (_req(v=1.0), "unsupported_version", "x"),
    "missing version": ({"t": "health", "id": "x"}, "unsupported_version", "x"),
    "id not a string": (_req(id=17), "invalid_request", 17),
    "id missing": ({"v": 1, "t": "generate", "prompt": "a"}, "invalid_request", None),
    "id empty": (_req(id=""), "invalid_request", ""),
    "prompt missing": ({"v": 1, "t": "generate", "id": "x"}, "invalid_request", "x"),
    "prompt an int": (_req(prompt=42), "invalid_request", "x"),
    "prompt bytes": (_req(prompt=b"abc"), "invalid_request", "x"),
    "prompt empty": (_req(prompt=""), "invalid_request", "x"),
    "prompt ids not ints": (_req(prompt=[1, "2"]), "invalid_request", "x"),
    "prompt id out of vocab": (_req(prompt=[1, 10 ** 9]), "invalid_request", "x"),
    "params a list": (_req(params=[1]), "invalid_request", "x"),
    "params wrong type": (_req(params={"max_tokens": "8"}), "invalid_request", "x"),
    "params unknown field": (_req(params={"max_tokenz": 8}), "invalid_request", "x"),
    "temperature negative": (_req(params={"temperature": -1.0}), "invalid_request", "x"),
    "temperature nan": (_req(params={"temperature": float("nan")}), "invalid_request", "x"),
    "top_p out of range": (_req(params={"top_p": 1.5}), "invalid_request", "x"),
    "stop not strings": (_req(params={"stop": [1]}), "invalid_request", "x"),
    "max_tokens zero": (_req(params={"max_tokens": 0}), "invalid_request", "x"),
    "max_tokens over limit": (_req(params={"max_tokens": MAX_TOKENS_LIMIT + 1}), "invalid_request", "x"),
    "max_tokens huge": (_req(params={"max_tokens": 2 ** 63}), "invalid_request", "x"),
    "huge prompt text": (_req(prompt="lambda " * 5000), "invalid_request", "x"),
    "prompt too many tokens": (_req(t="stream", prompt=[5] * (MAX_PROMPT + 1)), "invalid_request", "x"),
    "cancel unknown id": (_req(t="cancel", id="nope"), "unknown_request", "nope"),
    "oversize message": (_req(prompt="x" * (MSG_LIMIT + 10)), "too_large", "x"),
}


@amod
@pytest.mark.parametrize("case", list(BAD))
async def test_bad_input_gets_its_error_and_server_keeps_serving(case, raw, server, engine):
    data, code, rid = BAD[case]
    reply = await raw.ask(data)
    assert reply["t"] == "error" and reply["v"] == 1
    assert reply["code"] == code, reply
    assert reply["id"] == rid
    assert isinstance(reply["message"], str) and reply["message"]
    # the same connection still works, and so does another client
    ok = await raw.ask({"v": 1, "t": "generate", "id": "after", "prompt": "import os", "params": greedy(6)})
    assert ok["t"] == "result" and ok["token_ids"] == (await reference(engine, "import os", 6)).token_ids
    await assert_serves(server, engine)


@amod
async def test_client_maps_error_codes_to_exceptions(client):
    with pytest.raises(InvalidRequestError) as ei:
        await client.generate("import os", {"max_tokens": MAX_TOKENS_LIMIT + 1})
    assert ei.value.code == "invalid_request" and "limit" in str(ei.value)
    with pytest.raises(InvalidRequestError):
        await client.generate("import os", {"top_p": 0})
    with pytest.raises(P.TooLargeError):
        await client.generate("y" * (MSG_LIMIT + 1), greedy(2))
    with pytest.raises(InvalidRequestError):
        [d async for d in client.stream([5] * (MAX_PROMPT + 1), greedy(2))]
    for code, cls in P.ERROR_CLASSES.items():
        err = P.error_from_reply({"t": "error", "code": code, "message": "m"})
        assert isinstance(err, cls) and err.code == code
    odd = P.error_from_reply({"t": "error", "code": "brand_new", "message": "m"})
    assert odd.code == "brand_new"


@amod
async def test_duplicate_id_is_rejected_and_original_continues(raw, engine):
    ref = await reference(engine, PROMPTS[0], 40)
    await raw.send(_req(t="stream", id="d", prompt=PROMPTS[0], params=greedy(40)))
    await raw.send(_req(t="generate", id="d"))
    msgs = []
    while not msgs or msgs[-1]["t"] not in ("done",):
        msgs.append(await raw.recv())
    errors = [m for m in msgs if m["t"] == "error"]
    assert len(errors) == 1 and errors[0]["code"] == "duplicate_id" and errors[0]["id"] == "d"
    assert [t for m in msgs if m["t"] == "delta" for t in m["token_ids"]] == ref.token_ids
    assert msgs[-1]["finish_reason"] == "length"
    # once done, "d" may be used again
    again = await raw.ask(_req(t="generate", id="d", prompt=PROMPTS[0], params=greedy(5)))
    assert again["t"] == "result" and again["token_ids"] == ref.token_ids[:5]


@amod
async def test_multipart_and_req_style_framing_rejected(raw, server, engine):
    await raw.sock.send_multipart([b"", msgpack.packb(_req())])  # REQ's envelope: the error comes back in it
    empty, data = await asyncio.wait_for(raw.sock.recv_multipart(), REPLY_TIMEOUT)
    reply = msgpack.unpackb(data)
    assert empty == b"" and reply["code"] == "bad_message" and "delimiter" in reply["message"]
    assert reply["id"] == "x" and reply["re"] == "generate"
    await raw.sock.send_multipart([msgpack.packb(_req(id="y")), b"extra"])  # the id is read from either frame
    reply = await raw.recv()
    assert reply["code"] == "bad_message" and reply["id"] == "y"
    # a real REQ socket can read its error (it drops any reply without the delimiter, and would wait forever)
    ctx = zmq.asyncio.Context()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(server.endpoint)
    try:
        await req.send(msgpack.packb({"v": 1, "t": "health", "id": "q"}))
        assert await req.poll(int(REPLY_TIMEOUT * 1000)), "a REQ client got no reply"
        reply = msgpack.unpackb(await req.recv())
        assert reply["code"] == "bad_message" and reply["id"] == "q"
    finally:
        req.close(linger=0)
        ctx.term()
    await assert_serves(server, engine)


@amod
async def test_message_over_hard_limit_is_dropped_by_zmq(server, engine):
    """Past MAXMSGSIZE libzmq drops the message and the connection: no reply, nobody else affected."""
    r = Raw(server.endpoint)
    try:
        await r.send(_req(prompt="z" * (server.hard_limit + 100)))
        with pytest.raises(TimeoutError):
            await r.recv(timeout=1.0)
    finally:
        r.close()
    await assert_serves(server, engine)


@amod
async def test_garbage_fuzz_never_breaks_the_server(server, engine):
    """Random bytes and random msgpack values: every one gets an error reply (or a result), the server survives,
    and a concurrent well-behaved stream is unaffected."""
    rng = random.Random(7)
    atoms = [None, True, 0, -1, 2 ** 40, 1.5, float("inf"), "", "generate", "stream", "cancel", "x" * 50,
             b"\x00\xff", [], {}, [1, 2], {"t": "generate"}]

    def value(depth=0):
        if depth > 2 or rng.random() < 0.5:
            return rng.choice(atoms)
        if rng.random() < 0.5:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(["t", "v", "id", "prompt", "params", "max_tokens"]): value(depth + 1)
                for _ in range(rng.randint(0, 4))}

    blobs = [os.urandom(rng.randint(0, 64)) for _ in range(60)]
    for _ in range(140):
        m = value()
        if isinstance(m, dict) and rng.random() < 0.7:
            m.update(v=1, t=rng.choice(P.REQUEST_TYPES), id=f"f{rng.randint(0, 5)}")
            if "params" in m and not isinstance(m["params"], dict):
                m["params"] = {"max_tokens": rng.choice([0, 1, 3, 10 ** 6, "3", None])}
        blobs.append(msgpack.packb(m))

    async with Client(server.endpoint, timeout=REPLY_TIMEOUT) as good:
        ref = await reference(engine, PROMPTS[3], 60)
        stream = asyncio.ensure_future(_collect(good.stream(PROMPTS[3], greedy(60))))
        r = Raw(server.endpoint)
        try:
            for b in blobs:
                await r.send(b)
            # each message gets at least one reply; drain until quiet
            replies = []
            while True:
                try:
                    replies.append(await r.recv(timeout=2.0))
                except TimeoutError:
                    break
        finally:
            r.close()
        tokens = await stream
    assert tokens == ref.token_ids
    assert len(replies) >= len(blobs)  # every message gets at least one reply
    assert all(m["t"] in P.REPLY_TYPES and m["v"] == 1 for m in replies)
    assert not [m for m in replies if m["t"] == "error" and m["code"] == "internal"]
    await assert_serves(server, engine)
    assert engine.health()["ok"]


async def _collect(agen):
    return [t async for d in agen for t in d.token_ids]


@amod
async def test_per_client_inflight_limit(engine):
    async with Server(engine, "tcp://127.0.0.1:*", max_inflight_per_client=2) as s:
        r = Raw(s.endpoint)
        try:
            for i in range(3):
                await r.send(_req(t="stream", id=f"o{i}", prompt=PROMPTS[0], params=greedy(40)))
            msgs = []
            while sum(m["t"] in ("done", "error") for m in msgs) < 3:
                msgs.append(await r.recv())
        finally:
            r.close()
        errs = [m for m in msgs if m["t"] == "error"]
        assert [(m["id"], m["code"]) for m in errs] == [("o2", "overloaded")]
        async with Client(s.endpoint, timeout=REPLY_TIMEOUT) as c:
            with pytest.raises(OverloadedError):
                await asyncio.gather(*(c.generate(PROMPTS[0], greedy(30)) for _ in range(3)))


@amod
async def test_vanished_client_requests_are_aborted(server, engine):
    before = (server.stats.clients_dropped, engine.stats()["aborted"])
    r = Raw(server.endpoint)
    await r.send(_req(t="stream", id="gone", prompt=PROMPTS[1], params=greedy(MAX_TOKENS_LIMIT)))
    assert (await r.recv())["t"] == "delta"
    r.close()
    deadline = time.monotonic() + 5
    while server.stats.clients_dropped == before[0] and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert server.stats.clients_dropped == before[0] + 1
    assert engine.stats()["aborted"] >= before[1] + 1
    await assert_serves(server, engine)


@amod
async def test_disconnected_client_generate_requests_are_aborted_at_once(server, engine):
    """A non-streamed request sends nothing until its result, so only the connection's close can tell the
    server its client is gone: it must abort the work then, not run it to the end."""
    before = (server.stats.clients_dropped, engine.stats()["aborted"], engine.stats()["output_tokens"])
    r = Raw(server.endpoint)
    await r.send(_req(id="g", prompt=PROMPTS[1], params=greedy(MAX_TOKENS_LIMIT)))
    deadline = time.monotonic() + 5
    while engine.stats()["running"] == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    r.close()
    while server.stats.clients_dropped == before[0] and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    assert server.stats.clients_dropped == before[0] + 1
    # aborted, well before its MAX_TOKENS_LIMIT tokens: unnoticed, it would have run to the end and only its result's send
    # would have failed
    assert engine.stats()["aborted"] == before[1] + 1
    assert engine.stats()["output_tokens"] - before[2] < MAX_TOKENS_LIMIT
    while engine.stats()["running"] + engine.stats()["waiting"] and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert engine.stats()["running"] + engine.stats()["waiting"] == 0
    await assert_serves(server, engine)


@amod
async def test_a_new_connection_on_a_reused_descriptor_is_not_taken_for_the_closed_one(server, engine):
    """The operating system hands a closed connection's descriptor to the next one: a client that connects
    right after another one left must keep its requests."""
    ref = await reference(engine, PROMPTS[0], 24)
    for _ in range(5):
        gone = Raw(server.endpoint)
        for i in range(3):
            await gone.send(_req(id=f"g{i}", prompt=PROMPTS[1], params=greedy(MAX_TOKENS_LIMIT)))
        assert (await gone.ask(_req(t="health")))["t"] == "health"  # its requests have been read
        gone.close()
        fresh = Raw(server.endpoint)
        try:
            reply = await fresh.ask(_req(id="mine", prompt=PROMPTS[0], params=greedy(24)))
            assert reply["t"] == "result", reply
            assert (reply["token_ids"], reply["finish_reason"]) == (ref.token_ids, ref.finish_reason)
        finally:
            fresh.close()


# -- engine failures, with a stand-in engine ---------------------------------------------------------------------
class FakeEngine:
    def __init__(self, exc):
        self.exc = exc

    async def generate(self, prompt, params, request_id=None):
        raise self.exc

    async def stream(self, prompt, params, request_id=None):
        yield P.StreamDelta(request_id, "a", [1])
        raise self.exc

    async def abort(self, request_id):
        return False

    def health(self):
        return {"ok": False, "drafter_alive": False, "verifier_alive": True, "error": "worker died"}

    def stats(self):
        raise RuntimeError("no stats")


@pytest.mark.parametrize("exc,code", [(EngineDeadError("worker drafter died"), "engine_dead"),
                                      (OverloadedError("queue full"), "overloaded"),
                                      (RuntimeError("a bug"), "internal")])
@amod
async def test_engine_errors_become_error_replies(exc, code):
    async with Server(FakeEngine(exc), "tcp://127.0.0.1:*") as s, Client(s.endpoint, timeout=5) as c:
        with pytest.raises(P.ERROR_CLASSES[code]) as ei:
            await c.generate("a")
        assert ei.value.code == code
        got = []
        with pytest.raises(P.ERROR_CLASSES[code]):
            async for d in c.stream("a"):
                got.append(d.text)
        assert got == ["a"]
        assert (await c.health())["ok"] is False
        assert "error" in await c.stats()  # the server survives a failing stats() too
        assert (await c.health())["error"] == "worker died"


# -- binding and CURVE -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint,local", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.0.0.2:*", True), ("tcp://localhost:5555", True),
    ("tcp://[::1]:5555", True), ("ipc:///tmp/minedraft.sock", True), ("inproc://x", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://192.168.1.10:5555", False),
    ("tcp://eth0:5555", False), ("tcp://[::]:5555", False), ("tcp://example.com:5555", False),
    ("pgm://eth0;239.192.1.1:5555", False)])
def test_loopback_detection(endpoint, local):
    assert is_loopback_endpoint(endpoint) is local
    if local:
        check_bind(endpoint, allow_remote=False)
    else:
        with pytest.raises(BindError, match="--allow-remote"):
            check_bind(endpoint, allow_remote=False)
        check_bind(endpoint, allow_remote=True)


@pytest.mark.parametrize("endpoint", ["127.0.0.1:5555", "tcp://127.0.0.1", "tcp://127.0.0.1:99999", "http://x"])
def test_malformed_bind_refused(endpoint):
    with pytest.raises(BindError):
        check_bind(endpoint, allow_remote=True)


@amod
async def test_non_loopback_bind_needs_allow_remote(engine):
    with pytest.raises(BindError, match="--allow-remote"):
        Server(engine, "tcp://0.0.0.0:*")
    async with Server(engine, "tcp://0.0.0.0:*", allow_remote=True) as s:
        port = s.endpoint.rsplit(":", 1)[1]
        async with Client(f"tcp://127.0.0.1:{port}", timeout=REPLY_TIMEOUT) as c:
            assert (await c.health())["ok"]


@amod
async def test_curve_server_key_required(engine, tmp_path):
    public = write_keypair(tmp_path / "s.secret", tmp_path / "s.public")
    assert oct(os.stat(tmp_path / "s.secret").st_mode & 0o777) == "0o600"
    assert load_key(tmp_path / "s.public", "public").decode() == public
    async with Server(engine, "tcp://127.0.0.1:*", curve_secret_key=tmp_path / "s.secret",
                      curve_public_key=tmp_path / "s.public") as s:
        assert s.public_key == public
        async with Client(s.endpoint, server_public_key=tmp_path / "s.public", timeout=REPLY_TIMEOUT) as c:
            r = await c.generate(PROMPTS[0], greedy(12))
        assert r.token_ids == (await reference(engine, PROMPTS[0], 12)).token_ids
        async with Client(s.endpoint, server_public_key=public, timeout=REPLY_TIMEOUT) as c:  # key as text
            assert (await c.health())["ok"]
        # no keys at all: the handshake never completes, so no reply ever comes
        async with Client(s.endpoint, timeout=0.5) as c:
            with pytest.raises(TimeoutError):
                await c.generate(PROMPTS[0], greedy(4))
        # the wrong server key: same
        other_public, _ = zmq.curve_keypair()
        async with Client(s.endpoint, server_public_key=other_public, timeout=0.5) as c:
            with pytest.raises(TimeoutError):
                await c.health()


@amod
async def test_curve_client_allow_list(engine, tmp_path):
    write_keypair(tmp_path / "s.secret", tmp_path / "s.public")
    write_keypair(tmp_path / "alice.secret", tmp_path / "alice.public")
    write_keypair(tmp_path / "mallory.secret", tmp_path / "mallory.public")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "alice.public").write_text((tmp_path / "alice.public").read_text())
    async with Server(engine, "tcp://127.0.0.1:*", curve_secret_key=tmp_path / "s.secret",
                      curve_client_keys=allowed) as s:
        async with Client(s.endpoint, server_public_key=tmp_path / "s.public", timeout=REPLY_TIMEOUT,
                          client_public_key=tmp_path / "alice.public",
                          client_secret_key=tmp_path / "alice.secret") as c:
            assert (await c.generate(PROMPTS[2], greedy(6))).token_ids == \
                (await reference(engine, PROMPTS[2], 6)).token_ids
        async with Client(s.endpoint, server_public_key=tmp_path / "s.public", timeout=0.5,
                          client_public_key=tmp_path / "mallory.public",
                          client_secret_key=tmp_path / "mallory.secret") as c:
            with pytest.raises(TimeoutError):
                await c.health()
        async with Client(s.endpoint, server_public_key=tmp_path / "s.public", timeout=0.5) as c:  # ephemeral
            with pytest.raises(TimeoutError):
                await c.health()


def test_curve_key_errors(tmp_path):
    (tmp_path / "junk").write_text("not a key\n")
    with pytest.raises(ValueError, match="no z85 CURVE secret key"):
        Server(None, "tcp://127.0.0.1:*", curve_secret_key=tmp_path / "junk")
    with pytest.raises(ValueError, match="cannot read"):
        Server(None, "tcp://127.0.0.1:*", curve_secret_key=tmp_path / "missing")
    write_keypair(tmp_path / "a.secret", tmp_path / "a.public")
    write_keypair(tmp_path / "b.secret", tmp_path / "b.public")
    with pytest.raises(ValueError, match="does not belong"):
        Server(None, "tcp://127.0.0.1:*", curve_secret_key=tmp_path / "a.secret",
               curve_public_key=tmp_path / "b.public")
    with pytest.raises(FileExistsError):
        write_keypair(tmp_path / "a.secret", tmp_path / "a.public")


def test_protocol_helpers_roundtrip():
    res = GenerationResult("q", "hi", [1, 2], "length", RequestStats(prompt_tokens=3, output_tokens=2, steps=1))
    back = P.result_from_reply(P.decode(P.encode(P.result_reply("q", res))))
    assert back.text == "hi" and back.token_ids == [1, 2] and back.stats.output_tokens == 2
    assert P.peek_fields(msgpack.packb({"prompt": "x" * 1000, "id": "abc", "t": "stream"})) == \
        {"id": "abc", "t": "stream"}
    assert P.peek_fields(b"\xc1garbage") == {}


@amod
async def test_client_deadline_covers_the_send():
    """With no server listening, the socket queues sends until its high-water mark (1000), then a send itself
    waits: every call must still fail with TimeoutError within its deadline, not hang in the send."""
    import socket
    with socket.socket() as sk:  # a free port that nothing listens on
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    async with Client(f"tcp://127.0.0.1:{port}", timeout=0.5) as c:
        calls = [c.health() for _ in range(1005)] + [c.stats(), c.generate("x", greedy(2)),
                                                    _collect(c.stream("x", greedy(2)))]
        t0 = time.monotonic()
        got = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
        assert all(isinstance(g, TimeoutError) for g in got), {type(g).__name__ for g in got}
        assert time.monotonic() - t0 < 10
