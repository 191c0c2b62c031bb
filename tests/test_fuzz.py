"""Property-based fuzzing (hypothesis) of the pieces that take arbitrary input: the sampler, the paged KV cache's
bookkeeping, control-message decoding, and the network protocol's request decoder and params parsing.

The example counts are bounded so the file runs in well under 30 s on a small CI box; the runs are
derandomized (reproducible) unless MINEDRAFT_FUZZ_RANDOM=1. MINEDRAFT_FUZZ_SCALE=10 runs ten times the examples.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minedraft.cache.paged_kv import BlockAllocator, PagedKVCache
from minedraft.errors import InvalidRequestError, MinedraftError
from minedraft.ipc import messages as M
from minedraft.ipc.codec import decode_cmd, decode_drafts, decode_status, decode_to_drafter, encode
from minedraft.sampling.reference import accept, process_logits
from minedraft.sampling_params import SamplingParams

try:
    from minedraft.serving.zmq import protocol as P
except ImportError:  # the network protocol is optional for this file
    P = None

SCALE = float(os.environ.get("MINEDRAFT_FUZZ_SCALE", "1"))
RANDOM = os.environ.get("MINEDRAFT_FUZZ_RANDOM") == "1"


def fuzz(n: int, **kw):
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, database=None, derandomize=not RANDOM,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], **kw)


# -- sampler ---------------------------------------------------------------------------------------------------
@st.composite
def sampler_cases(draw):
    V = draw(st.integers(2, 24))
    k = draw(st.integers(0, 5))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([0.01, 1.0, 5.0, 40.0]))
    target = torch.randn(k + 1, V, generator=g) * scale
    if draw(st.booleans()):
        target = target.round()  # ties: argmax, top-k thresholds and top-p cut-offs on equal values
    if draw(st.booleans()):
        params = SamplingParams(temperature=0.0, top_k=draw(st.integers(0, V + 2)),
                                top_p=draw(st.floats(0.01, 1.0)))
    else:
        params = SamplingParams(temperature=draw(st.floats(0.05, 4.0)), top_k=draw(st.integers(0, V + 2)),
                                top_p=draw(st.floats(0.01, 1.0)))
    if params.greedy:
        # drafts that follow the target's argmax for a random stretch, then anything
        argmax = target.argmax(-1).tolist()
        agree = draw(st.integers(0, k))
        drafts = argmax[:agree] + [draw(st.integers(0, V - 1)) for _ in range(k - agree)]
        q = None
    else:
        # the draft distribution went through the same processing; drafts are samples of it
        mix = draw(st.floats(0.0, 1.0))  # 0: draft == target, 1: an unrelated draft model
        draft_logits = (1 - mix) * target[:k] + mix * torch.randn(k, V, generator=g) * scale
        q = process_logits(draft_logits, params) if k else torch.zeros(0, V)
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
    return V, k, target, params, drafts, q, draw(st.integers(0, 2**32 - 1))


@fuzz(400)
@given(sampler_cases())
def test_accept_returns_in_range_token_with_positive_target_probability(case):
    V, k, target, params, drafts, q, seed = case
    n, tok = accept(drafts, q, target, params, torch.Generator().manual_seed(seed))
    assert isinstance(n, int) and isinstance(tok, int)
    assert 0 <= n <= k
    assert 0 <= tok < V
    if params.greedy:
        argmax = target.argmax(-1).tolist()
        m = 0
        while m < k and drafts[m] == argmax[m]:
            m += 1
        assert n == m, "greedy accept must return the longest prefix matching the target's argmax"
        assert tok == argmax[n]
    else:
        p = process_logits(target, params)
        assert p[n, tok] > 0, "the emitted token must be possible under the processed target distribution"
        for i in range(n):  # accepted drafts are possible under the target too
            assert p[i, drafts[i]] > 0


@fuzz(300)
@given(V=st.integers(1, 40), rows=st.integers(1, 4), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([0.01, 1.0, 10.0, 80.0]), ties=st.booleans(),
       temperature=st.floats(0.02, 5.0), top_k=st.integers(0, 45), top_p=st.floats(0.001, 1.0))
def test_process_logits_is_a_filtered_distribution(V, rows, seed, scale, ties, temperature, top_k, top_p):
    x = torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * scale
    if ties:
        x = x.round()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    p = process_logits(x, params)
    assert p.shape == x.shape and torch.isfinite(p).all() and (p >= 0).all()
    assert torch.allclose(p.sum(-1), torch.ones(rows), atol=1e-5)
    xs = x.float() / temperature  # the order the filters see
    is_max = xs == xs.max(-1, keepdim=True).values
    assert ((p > 0) & is_max).any(-1).all(), "the most likely token always survives the filters"
    if top_k and top_k < V:
        kth = torch.topk(xs, top_k, -1).values[:, -1:]
        assert not (p[xs < kth] > 0).any(), "a token below the k-th logit survived top-k"
    if top_p < 1.0:
        # every kept token is needed: the mass strictly above it (in the tempered, top-k'd law) is < top_p
        base = process_logits(x, SamplingParams(temperature=temperature, top_k=top_k))
        for r in range(rows):
            for t in (p[r] > 0).nonzero().flatten().tolist():
                above = base[r][base[r] > base[r, t]].sum()
                assert above < top_p + 1e-5
            assert base[r][p[r] > 0].sum() >= min(top_p, 1.0) - 1e-5, "the kept set must reach top_p"


# -- paged KV cache --------------------------------------------------------------------------------------------
SEQ_IDS = st.integers(0, 6)


class PagedCacheMachine(RuleBasedStateMachine):
    """Random allocate / write+extend / truncate / free sequences against a plain model of the bookkeeping."""

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 8))
    def setup(self, num_blocks, block_size):
        self.bs = block_size
        self.cache = PagedKVCache(1, 1, 1, num_blocks * block_size, block_size)
        self.total = num_blocks
        self.cap: dict[int, int] = {}     # seq -> reserved positions
        self.len: dict[int, int] = {}     # seq -> length

    def _snapshot(self):
        c = self.cache
        return (dict(c._tables), dict(c._lengths), dict(c._capacity), list(c.allocator._free),
                set(c.allocator._used))

    @rule(seq=SEQ_IDS, tokens=st.integers(0, 60))
    def allocate(self, seq, tokens):
        before = self._snapshot()
        need = -(-tokens // self.bs)
        if seq in self.cap:
            with pytest.raises(ValueError):
                self.cache.allocate(seq, tokens)
            assert self._snapshot() == before
        elif need > self.total - sum(-(-c // self.bs) for c in self.cap.values()):
            assert not self.cache.can_allocate(tokens)
            with pytest.raises(MemoryError):
                self.cache.allocate(seq, tokens)
            assert self._snapshot() == before, "a failed allocation changed the cache"
        else:
            assert self.cache.can_allocate(tokens)
            self.cache.allocate(seq, tokens)
            self.cap[seq], self.len[seq] = need * self.bs, 0
            assert self.cache.length(seq) == 0

    @precondition(lambda self: self.cap)
    @rule(data=st.data(), n=st.integers(0, 30))
    def write_and_extend(self, data, n):
        """What the model runner does: address positions [len, len+n), then extend by n."""
        seq = data.draw(st.sampled_from(sorted(self.cap)))
        start = self.len[seq]
        before = self._snapshot()
        if start + n > self.cap[seq]:
            with pytest.raises(MemoryError):
                self.cache.slots(seq, start, start + n)
            assert self._snapshot() == before
            return
        slots = self.cache.slots(seq, start, start + n).tolist()
        blocks = set(self.cache._tables[seq])
        assert len(set(slots)) == len(slots), "two positions map to one cache slot"
        assert all(s // self.bs in blocks for s in slots), "a position maps outside the sequence's own blocks"
        self.cache.extend(seq, n)
        self.len[seq] = start + n

    @precondition(lambda self: self.cap)
    @rule(data=st.data(), new_length=st.integers(-3, 70))
    def truncate(self, data, new_length):
        seq = data.draw(st.sampled_from(sorted(self.cap)))
        before = self._snapshot()
        if 0 <= new_length <= self.len[seq]:
            self.cache.truncate(seq, new_length)
            self.len[seq] = new_length
        else:
            with pytest.raises(ValueError):  # never grows, never negative
                self.cache.truncate(seq, new_length)
            assert self._snapshot() == before

    @rule(seq=SEQ_IDS)
    def free(self, seq):
        self.cache.free(seq)  # freeing an unknown / already freed sequence is a no-op
        self.cap.pop(seq, None)
        self.len.pop(seq, None)

    @precondition(lambda self: self.cache.allocator.num_free > 0)
    @rule(data=st.data())
    def double_free_is_refused(self, data):
        """Freeing a block a second time (a bookkeeping bug) raises and never duplicates it in the free list."""
        a = self.cache.allocator
        free_blocks = sorted(set(range(self.total)) - a._used)
        if not free_blocks:
            return
        b = data.draw(st.sampled_from(free_blocks))
        before = self._snapshot()
        with pytest.raises(ValueError):
            a.free([b])
        assert self._snapshot() == before

    @invariant()
    def bookkeeping_is_consistent(self):
        c = self.cache
        a = c.allocator
        assert c.used_blocks + a.num_free == self.total == c.num_blocks
        assert len(a._free) == len(set(a._free)), "a block is twice in the free list"
        assert not (set(a._free) & a._used), "a block is both free and used"
        assert set(a._free) | a._used == set(range(self.total))
        owned = [b for t in c._tables.values() for b in t]
        assert len(owned) == len(set(owned)), "a block is owned by two sequences"
        assert set(owned) == a._used, "used blocks and block tables disagree"
        assert c.num_seqs == len(self.cap) and set(c._tables) == set(self.cap)
        for s in self.cap:
            assert c._capacity[s] == self.cap[s] == len(c._tables[s]) * self.bs
            assert c.length(s) == self.len[s] <= self.cap[s]


TestPagedCacheMachine = PagedCacheMachine.TestCase
TestPagedCacheMachine.settings = fuzz(150, stateful_step_count=40)


@fuzz(200)
@given(num_blocks=st.integers(1, 20), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 25)), max_size=40))
def test_block_allocator_random_ops(num_blocks, ops):
    a = BlockAllocator(num_blocks)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            if n > a.num_free:
                free_before = list(a._free)
                with pytest.raises(MemoryError):
                    a.allocate(n)
                assert a._free == free_before
            else:
                got = a.allocate(n)
                assert len(got) == n == len(set(got))
                held.append(got)
        elif held:
            a.free(held.pop(n % len(held)))
        owned = [b for h in held for b in h]
        assert len(owned) == len(set(owned)) and set(owned) == a._used
        assert a.num_free + len(owned) == num_blocks


def test_extend_past_reservation_raises_memory_error():
    c = PagedKVCache(1, 1, 1, 8 * 4, 4)
    c.allocate("s", 6)  # 2 blocks: 8 positions
    with pytest.raises(MemoryError):
        c.extend("s", 9)
    assert c.length("s") == 0


# -- control-message codec -------------------------------------------------------------------------------------
# What "decoding failed" may look like: ValueError (msgspec's DecodeError and ValidationError, an invalid
# SamplingParams inside an Add, UnicodeDecodeError are all ValueErrors) or msgpack's UnpackException family
# (OutOfData, BufferFull; kept for the protocol decoder in the garbage test). Anything else is a bug.
DECODE_ERRORS = (ValueError, msgpack.UnpackException)

scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
           | st.text(max_size=20) | st.binary(max_size=20))
msgpack_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                              | st.dictionaries(st.text(max_size=8), inner, max_size=5), max_leaves=20)

# each socket's decoder and the messages it may return (ipc/messages.py)
SOCKETS = [(decode_cmd, M.CmdMsg), (decode_drafts, M.DraftsMsg), (decode_to_drafter, M.ToDrafterMsg),
           (decode_status, M.StatusMsg)]

valid_params = st.builds(
    SamplingParams, temperature=st.floats(0, 10), top_k=st.integers(0, 2**31 - 1), top_p=st.floats(0.01, 1.0),
    max_tokens=st.integers(1, 2**31 - 1), stop_token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=3),
    stop=st.lists(st.text("abc xyz", min_size=1, max_size=4), max_size=2),
    seed=st.none() | st.integers(0, 2**63 - 1), ignore_eos=st.booleans())
st.register_type_strategy(SamplingParams, valid_params)
control_messages = st.one_of(*(st.from_type(cls) for cls in M.CONTROL))


def _encode_or_reject(msg) -> bytes:
    try:
        return encode(msg)
    except OverflowError:  # hypothesis' ints go past msgpack's 64 bits; the engine's never do
        reject()


def _mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        if op == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            del b[rng.randrange(len(b)):]
        elif op == 2:
            b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
        elif b:
            i = rng.randrange(len(b))
            b[i] = rng.choice([0xc1, 0xdc, 0xdd, 0xde, 0xdf, 0xc4, 0xc5, 0xc6, 0xd4, 0xc7, 0xff, 0x00])
    return bytes(b)


def _decodes_to_member(decode, union, data: bytes) -> None:
    """data either fails cleanly or decodes to one of the socket's messages."""
    try:
        msg = decode(data)
    except DECODE_ERRORS:
        return
    assert isinstance(msg, union.__args__)


@fuzz(500)
@given(st.binary(max_size=200))
def test_codec_unpack_arbitrary_bytes_fails_cleanly(data):
    for decode, union in SOCKETS:
        _decodes_to_member(decode, union, data)


@fuzz(300)
@given(control_messages, st.integers(0, 2**32 - 1))
def test_codec_roundtrip_and_mutations(msg, seed):
    data = _encode_or_reject(msg)
    carried = [decode for decode, union in SOCKETS if isinstance(msg, union.__args__)]
    assert carried
    for decode in carried:
        back = decode(data)
        assert type(back) is type(msg) and encode(back) == data  # bytes: equal even with NaN floats
    rng = random.Random(seed)
    for _ in range(5):
        bad = _mutate(data, rng)
        for decode, union in SOCKETS:
            _decodes_to_member(decode, union, bad)


@pytest.mark.parametrize("data", [b"\x81\x91\x01\x01", b"\x81\x80\x01"], ids=["array-key", "map-key"])
def test_codec_unpack_unhashable_key_raises_value_error(data):
    for decode, _ in SOCKETS:
        with pytest.raises(DECODE_ERRORS):
            decode(data)


def test_decoders_never_crash_or_hang_on_garbage(tmp_path):
    """20k random and mutated frames through every decoder in a child process: it must exit normally (no
    segfault, no abort), within a timeout (no hang), having seen only the allowed exceptions."""
    script = tmp_path / "garbage.py"
    script.write_text(textwrap.dedent("""
        import random, sys, collections
        import msgpack
        from minedraft.ipc import codec, messages as M
        from minedraft.sampling_params import SamplingParams
        try:
            from minedraft.serving.zmq import protocol as P
        except ImportError:
            P = None
        rng = random.Random(12345)
        seen = collections.Counter()
        allowed = (ValueError, msgpack.UnpackException)
        decoders = (codec.decode_cmd, codec.decode_drafts, codec.decode_to_drafter, codec.decode_status)
        req = M.NewRequest(1, [5, 6, 7], SamplingParams(temperature=0.7, stop=["x"]), 99)
        seeds = [codec.encode(M.Verdict(1, 0, [M.StepResult(3, [1, 2], 4, 2, None)], 0.5, 0.6, False, 0.1, 0.2,
                                        4, False)),
                 codec.encode(M.Add(req)),
                 codec.encode(M.Drafts(0, 1, [1], [req], [], M.DraftsDesc(0, 1, 4, 0), 0.1, 0.2, 4, False)),
                 msgpack.packb({"v": 1, "t": "generate", "id": "r1", "prompt": "hi", "params": {"top_k": 5}})]
        for i in range(20000):
            if i % 2:
                data = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
            else:
                b = bytearray(rng.choice(seeds))
                for _ in range(rng.randint(1, 4)):
                    j = rng.randrange(len(b) or 1)
                    if b and rng.random() < 0.5:
                        b[j] = rng.randrange(256)
                    elif b and rng.random() < 0.5:
                        del b[j:]
                    else:
                        b.insert(j, rng.randrange(256))
                data = bytes(b)
            for decode in decoders:
                try:
                    decode(data)
                    seen["ok"] += 1
                except allowed as e:
                    seen[type(e).__name__] += 1
            if P is not None:
                try:
                    P.parse_request(P.decode(data))
                except (P.BadMessageError, P.RequestError):
                    pass
                P.peek_fields(data)
        print(dict(seen))
    """))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's minedraft, not another
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


# -- protocol (network requests) -------------------------------------------------------------------------------
needs_protocol = pytest.mark.skipif(P is None, reason="minedraft.serving.zmq.protocol not available")

REQ_KEYS = st.sampled_from(["v", "t", "id", "prompt", "params"]) | st.text(max_size=6)
request_like = st.dictionaries(REQ_KEYS, msgpack_values | st.sampled_from(
    [1, "generate", "stream", "cancel", "health", "stats", "r1", "", [1, 2, 3], {"max_tokens": 4}]), max_size=6)


@needs_protocol
@fuzz(500)
@given(st.binary(max_size=200))
def test_protocol_decode_raises_only_bad_message(data):
    try:
        P.decode(data)
    except P.BadMessageError as e:
        assert e.code == P.BAD_MESSAGE and len(str(e)) <= 300
    P.peek_fields(data)  # never raises


def _check_parsed(obj):
    try:
        req = P.parse_request(obj)
    except P.RequestError as e:
        assert e.code in P.ERROR_CODES and isinstance(e.message, str) and e.message
        assert e.id is None or isinstance(e.id, (str, int))
        assert e.t is None or e.t in P.REQUEST_TYPES
        return None
    assert req.t in P.REQUEST_TYPES
    assert isinstance(req.id, str) and 0 < len(req.id) <= P.MAX_ID_CHARS
    if req.t in ("generate", "stream"):
        assert (isinstance(req.prompt, str) and req.prompt) or (
            isinstance(req.prompt, list) and req.prompt
            and all(isinstance(x, int) and not isinstance(x, bool) for x in req.prompt))
        assert isinstance(req.params, dict)
    return req


@needs_protocol
@fuzz(500)
@given(request_like | msgpack_values)
def test_protocol_parse_request_on_arbitrary_objects(obj):
    _check_parsed(obj)


@needs_protocol
@fuzz(300)
@given(request_like, st.integers(0, 2**32 - 1))
def test_protocol_decode_parse_on_mutated_frames(obj, seed):
    frame = P.encode({"v": 1, **obj})
    rng = random.Random(seed)
    for data in [frame] + [_mutate(frame, rng) for _ in range(4)]:
        try:
            decoded = P.decode(data)
        except P.BadMessageError:
            continue
        _check_parsed(decoded)


@needs_protocol
@fuzz(200)
@given(st.dictionaries(st.text(max_size=8) | st.integers(), msgpack_values, max_size=4))
def test_protocol_error_from_reply_always_gives_an_error(msg):
    err = P.error_from_reply(msg)
    assert isinstance(err, MinedraftError) and isinstance(err.code, str)


PARAM_KEYS = st.sampled_from(sorted(SamplingParams.__dataclass_fields__)) | st.text(max_size=6)


@fuzz(500)
@given(st.dictionaries(PARAM_KEYS, msgpack_values, max_size=5))
def test_sampling_params_from_wire_dict_raises_only_invalid_request(d):
    """What a client can send as `params` (string keys, msgpack values): valid params or InvalidRequestError."""
    try:
        sp = SamplingParams.from_dict(d)
    except InvalidRequestError:
        return
    assert SamplingParams.from_dict(sp.to_dict()) == sp


@pytest.mark.parametrize("d", [{b"a": 1, "b": 2}, {1: 2, "x": 3}],
                         ids=["bytes+str", "int+str"])
def test_sampling_params_mixed_key_types_raise_invalid_request(d):
    with pytest.raises(InvalidRequestError):
        SamplingParams.from_dict(d)


@needs_protocol
def test_bytes_keys_are_bad_message_on_the_wire_and_invalid_in_the_api():
    """PROTOCOL.md: map keys are strings. A bin key anywhere (msgpack's strict_map_key lets bin through) is
    refused at decoding; the Python API refuses one in params as an invalid request."""
    with pytest.raises(P.BadMessageError, match="keys must be strings"):
        P.decode(P.encode({"v": 1, "t": "generate", "id": "r", "prompt": "hi", "params": {b"a": 1, "b": 2}}),
                 str_keys=True)
    with pytest.raises(P.BadMessageError):
        P.decode(P.encode({b"v": 1, "t": "health", "id": "r"}), str_keys=True)
    with pytest.raises(InvalidRequestError):
        SamplingParams.from_dict({b"a": 1, "b": 2})
