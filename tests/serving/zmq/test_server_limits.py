"""What one client can make the server hold or spend: bounded unread replies (a non-reading client is dropped),
message size sized to the prompt limit, prompt length checked before per-element work, no stall of other
clients' streams under a flood of oversize prompts; plus ids, stats fields and the stop rule over the wire."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from minedraft.cli import main as cli
from minedraft.serving.zmq import protocol as P
from minedraft.serving.zmq import server as server_mod
from minedraft.client import Client
from minedraft.config import EngineConfig
from minedraft.engine.engine import Engine
from minedraft.serving.zmq.server import Server

amod = pytest.mark.asyncio(loop_scope="module")
MAX_PROMPT = 64
REPLY_TIMEOUT = 15.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_pair):
    cfg = EngineConfig(target=tiny_pair.target, draft=tiny_pair.draft, k=3, max_prompt_tokens=MAX_PROMPT,
                       max_tokens_limit=256, kv_cache_tokens=8192, max_batch_size=16)
    async with Engine(cfg) as e:
        yield e


class Raw:
    def __init__(self, endpoint: str, rcvhwm: int | None = None):
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if rcvhwm is not None:
            self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
            self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.sock.connect(endpoint)

    async def send(self, msg) -> None:
        await self.sock.send(msg if isinstance(msg, bytes) else msgpack.packb(msg))

    async def recv(self, timeout: float = REPLY_TIMEOUT) -> dict:
        if not await self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("no reply")
        return msgpack.unpackb(await self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _req(t="generate", **kw) -> dict:
    return {"v": 1, "t": t, "id": "x", **kw}


def test_cli_default_matches_server():
    assert cli.DEFAULT_MAX_QUEUED_REPLIES == server_mod.DEFAULT_MAX_QUEUED_REPLIES


def test_message_limit_is_sized_to_the_prompt_limit(engine):
    s = Server(engine, "tcp://127.0.0.1:*")
    assert s.max_message_bytes == P.message_limit_for(MAX_PROMPT)
    # the longest acceptable prompt fits, in either form
    longest = {"v": 1, "t": "generate", "id": "i" * P.MAX_ID_CHARS, "params": {"max_tokens": 256},
               "prompt": "\U0001F600" * (P.PROMPT_CHARS_PER_TOKEN * MAX_PROMPT)}
    assert len(P.encode(longest)) <= s.max_message_bytes
    assert len(P.encode({**longest, "prompt": [2**63] * MAX_PROMPT})) <= s.max_message_bytes


def test_prompt_length_is_checked_before_its_elements():
    with pytest.raises(P.RequestError) as e:
        P.parse_request(_req(prompt=[1] * 100_000 + ["not an int"]), max_prompt_tokens=MAX_PROMPT)
    assert e.value.code == P.INVALID_REQUEST and "100001 token ids" in e.value.message
    with pytest.raises(P.RequestError) as e:
        P.parse_request(_req(prompt="a" * (16 * MAX_PROMPT + 1)), max_prompt_tokens=MAX_PROMPT)
    assert e.value.code == P.INVALID_REQUEST and "characters" in e.value.message
    assert P.parse_request(_req(prompt=[1] * MAX_PROMPT), max_prompt_tokens=MAX_PROMPT).prompt == [1] * MAX_PROMPT


@amod
async def test_client_that_never_reads_is_dropped_and_others_served(engine):
    """20k stats requests, never read (each reply ~0.7 KB: far more than socket buffers hold). Before, the server
    queued every reply (+97 MB per 200k); now at most max_queued_replies wait, then the client is dropped."""
    async with Server(engine, "tcp://127.0.0.1:*", max_queued_replies=50) as s:
        flood = Raw(s.endpoint, rcvhwm=1)
        try:
            msg = msgpack.packb({"v": 1, "t": "stats", "id": "s"})
            for _ in range(20_000):
                await flood.send(msg)
            deadline = time.monotonic() + 30
            while s.stats.received < 20_000 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert s.stats.slow_clients_dropped == 1
            assert s.stats.discarded > 0  # what it sent after being dropped was not even answered
            assert s.stats.replies < 20_000
            async with Client(s.endpoint, timeout=REPLY_TIMEOUT) as c:
                r = await c.generate("The class statement", {"max_tokens": 8, "ignore_eos": True})
                assert len(r.token_ids) == 8
                st = await c.stats()
            assert st["server"]["slow_clients_dropped"] == 1 and st["server"]["max_queued_replies"] == 50
        finally:
            flood.close()


@amod
async def test_oversize_prompt_flood_does_not_stall_another_stream(engine):
    """Generate messages with 1M-id prompts (over the hard limit: dropped by libzmq) and 60k-id prompts (under the
    size limit, over max_prompt_tokens: refused after one len()): a concurrent stream never pauses > 250 ms."""
    async with Server(engine, "tcp://127.0.0.1:*") as s, Client(s.endpoint, timeout=REPLY_TIMEOUT) as good:
        huge = msgpack.packb(_req(prompt=[1] * 1_000_000))
        big = msgpack.packb(_req(prompt=[1] * 60_000))
        assert s.max_message_bytes > len(big)  # decoded, then refused by length
        gaps: list[float] = []
        flooding = True

        async def streams():
            last = time.monotonic()
            while flooding:
                async for d in good.stream("The class statement", {"max_tokens": 64, "ignore_eos": True}):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

        async def flood():
            r = Raw(s.endpoint)
            try:
                for i in range(40):
                    await r.send(huge if i % 2 else big)
                    await asyncio.sleep(0.02)
                got = []  # the 60k ones are answered, unless libzmq had just closed the connection for a 1M one
                while True:
                    try:
                        got.append(await r.recv(timeout=2.0))
                    except TimeoutError:
                        return got
            finally:
                r.close()

        reader = asyncio.ensure_future(streams())
        await asyncio.sleep(0.3)
        try:
            replies = await asyncio.wait_for(flood(), 60)
        finally:
            flooding = False
            await asyncio.wait_for(reader, 30)
        assert len(gaps) > 20 and max(gaps) < 0.25, f"longest pause {max(gaps) * 1000:.0f} ms"
        assert replies and all(m["code"] == "invalid_request" and "60000 token ids" in m["message"]
                               for m in replies)


@amod
async def test_long_invalid_id_is_echoed_cut_and_marked(engine):
    async with Server(engine, "tcp://127.0.0.1:*") as s:
        r = Raw(s.endpoint)
        try:
            for msg in (_req(id="z" * 300, prompt="x"), {"v": 1, "t": "nope", "id": "q" * 300}):
                await r.send(msg)
                reply = await r.recv()
                assert reply["t"] == "error" and reply["id"] == msg["id"][:256] and reply["id_truncated"] is True
            await r.send(_req(id="ok", prompt=[]))
            reply = await r.recv()
            assert reply["id"] == "ok" and "id_truncated" not in reply and reply["re"] == "generate"
            await r.send(_req(id=None, prompt="x"))
            reply = await r.recv()  # a missing id: invalid_request with a nil id
            assert reply["code"] == "invalid_request" and reply["id"] is None
        finally:
            r.close()


@amod
async def test_stats_count_connected_clients(engine):
    async with Server(engine, "tcp://127.0.0.1:*") as s:
        raws = [Raw(s.endpoint) for _ in range(3)]
        try:
            for r in raws:
                await r.send({"v": 1, "t": "health", "id": "h"})
                assert (await r.recv())["t"] == "health"
            async with Client(s.endpoint, timeout=REPLY_TIMEOUT) as c:
                srv = (await c.stats())["server"]
            assert srv["connections"] == 4 and srv["clients"] == 0  # clients: with requests in flight
        finally:
            for r in raws:
                r.close()
        deadline = time.monotonic() + 5
        while s.peers.open and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert s.peers.open == 0


@amod
async def test_stop_rule_over_the_wire_matches_the_engine(engine, tiny_tokenizer):
    """The trigger of a stop ends token_ids and never appears in text: a stop token and a stop string alike."""
    prompt, n = "The class statement", 40
    ref = (await engine.generate(prompt, {"max_tokens": n, "ignore_eos": True})).token_ids
    j = next(j for j in range(3, n) if ref[j] not in ref[:j])
    text = tiny_tokenizer.decode(ref, skip_special_tokens=True)
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip() == text[i:i + 2])
    m = next(m for m in range(1, n + 1) if stop in tiny_tokenizer.decode(ref[:m], skip_special_tokens=True))
    async with Server(engine, "tcp://127.0.0.1:*") as s, Client(s.endpoint, timeout=REPLY_TIMEOUT) as c:
        by_id = await c.generate(prompt, {"max_tokens": n, "ignore_eos": True, "stop_token_ids": [ref[j]]})
        by_str = await c.generate(prompt, {"max_tokens": n, "ignore_eos": True, "stop": [stop]})
        streamed = [d async for d in c.stream(prompt, {"max_tokens": n, "ignore_eos": True,
                                                       "stop_token_ids": [ref[j]]})]
    direct = await engine.generate(prompt, {"max_tokens": n, "ignore_eos": True, "stop_token_ids": [ref[j]]})
    assert (direct.token_ids, direct.text) == (by_id.token_ids, by_id.text)
    assert by_id.token_ids == ref[:j + 1] and by_id.finish_reason == "stop"
    assert by_id.text == tiny_tokenizer.decode(ref[:j], skip_special_tokens=True)
    assert [t for d in streamed for t in d.token_ids] == by_id.token_ids
    assert "".join(d.text for d in streamed) == by_id.text
    assert by_str.token_ids == ref[:m] and by_str.finish_reason == "stop"
    assert by_str.text == text[:text.index(stop)]


@amod
async def test_stop_string_limits_over_the_wire(engine):
    """Hundreds of stop strings in one message (1,100 pushed other clients to 8.7-10.5 s, issue 35) are refused with an
    error naming the limit, before the request reaches the engine."""
    async with Server(engine, "tcp://127.0.0.1:*") as s:
        raw = Raw(s.endpoint)
        try:
            await raw.send(_req(prompt="The class statement",
                                params={"max_tokens": 8, "stop": [f"{i:04d}" + "q" * 91 for i in range(200)]}))
            m = await raw.recv()
        finally:
            raw.close()
    assert m["t"] == "error" and m["code"] == P.INVALID_REQUEST and "MAX_STOP_STRINGS" in m["message"], m
    assert engine.stats()["running"] == 0


def test_zmq_handshake_deadline_closes_silent_connections(monkeypatch):
    """A TCP connection that never completes ZeroMQ's handshake is closed after HANDSHAKE_IVL_MS (libzmq's own
    default is 30 s): the ZeroMQ side's header deadline."""
    import socket
    assert server_mod.HANDSHAKE_IVL_MS <= 10_000
    monkeypatch.setattr(server_mod, "HANDSHAKE_IVL_MS", 300)  # the option's effect, measured in test time
    s = Server(None, "tcp://127.0.0.1:*", max_message_bytes=1 << 20)
    try:
        s.bind()
        host, port = s.endpoint.rsplit("/", 1)[-1].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as c:
            c.settimeout(5)
            t0 = time.monotonic()
            while c.recv(4096):  # libzmq sends its greeting, then closes at the deadline
                pass
            assert time.monotonic() - t0 < 4
    finally:
        s._term()
