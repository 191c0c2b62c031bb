"""The messages between processes: ARCHITECTURE's table matches the declared types, every message survives its
socket's decoder, each socket's decoder refuses what another socket carries, and messages stay compact arrays."""

from __future__ import annotations

import inspect
import pickle
import re
from pathlib import Path

import msgspec
import pytest

from minedraft.config import DraftBudget, EngineConfig
from minedraft.ipc import codec
from minedraft.ipc import messages as M
from minedraft.sampling_params import SamplingParams

ARCH = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"


def declared() -> dict[str, type]:
    """Every Struct ipc/messages.py declares (its private base left out)."""
    return {name: cls for name, cls in vars(M).items()
            if inspect.isclass(cls) and issubclass(cls, msgspec.Struct) and cls.__module__ == M.__name__
            and not name.startswith("_")}


def table() -> dict[str, tuple[str, list[str]]]:
    """ARCHITECTURE.md "Messages between processes": name -> (tag, fields)."""
    text = ARCH.read_text()
    section = text[text.index("## Messages between processes"):]
    section = section[:m.start()] if (m := re.search(r"\n## ", section[3:])) else section
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 6 or not cells[0].startswith("`"):
            continue
        name, tag, fields = cells[0].strip("`"), cells[1].strip("`"), re.findall(r"`(\w+)`", cells[5])
        assert name not in rows, f"{name} twice in the table"
        rows[name] = (tag, fields)
    return rows


def test_architecture_table_lists_every_message_with_its_fields():
    rows, types = table(), declared()
    assert sorted(rows) == sorted(types), "the table and ipc/messages.py must name the same messages"
    for name, cls in types.items():
        tag, fields = rows[name]
        assert fields == list(cls.__struct_fields__), f"{name}: table fields differ from the declaration"
        assert tag == (cls.__struct_config__.tag or ""), f"{name}: table tag differs from the declaration"


def test_every_message_is_array_like_and_control_messages_are_tagged():
    for name, cls in declared().items():
        assert cls.__struct_config__.array_like, name
    tagged = {cls for cls in declared().values() if cls.__struct_config__.tag}
    assert tagged == set(M.CONTROL)
    unions = [M.CmdMsg, M.DraftsMsg, M.ToDrafterMsg, M.StatusMsg]
    assert set().union(*(u.__args__ for u in unions)) == set(M.CONTROL)  # every control message has a socket


PARAMS = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=12, stop_token_ids=(3, 9), stop=("x",),
                        seed=2**62, ignore_eos=True)
REQ = M.NewRequest(rid=7, prompt_ids=[5, 6, 7], params=PARAMS, seed=99)
ROWS = [M.StepResult(1, [4, 5, 6], 3, 2, None), M.StepResult(2, [8], 3, 0, "stop"),
        M.StepResult(3, [], 0, 0, "length")]
VERDICT = M.Verdict(batch=1, step=40, results=ROWS, t0=1.5, t1=1.75, prefill=True, draft_t0=1.0, draft_t1=1.25,
                    k=3, more=False)

# one of each control message, with the decoder of each socket that carries it
SAMPLES = [
    (M.Add(REQ), [codec.decode_cmd]),
    (M.Abort([1, 2, 2**40]), [codec.decode_cmd]),
    (M.SetK(0), [codec.decode_cmd]),
    (M.Probe(12), [codec.decode_cmd, codec.decode_drafts]),
    (M.Stop(), [codec.decode_cmd, codec.decode_drafts]),
    (M.Slots(b"\x00handles\xff"), [codec.decode_drafts]),
    (M.Drafts(0, 3, [1, 2], [REQ], [9], M.DraftsDesc(0, 2, 4, 49152), 0.25, 0.5, 4, False), [codec.decode_drafts]),
    (M.Drafts(1, 4, [], [], [3, 4], None, 0.0, 0.0), [codec.decode_drafts]),
    (M.Yield(1), [codec.decode_drafts]),
    (M.FeatureSlots(b"h"), [codec.decode_to_drafter]),
    (VERDICT, [codec.decode_status, codec.decode_to_drafter]),
    (M.Verdict(0, 1, [], 0.0, 0.0, False, 0.0, 0.0, 0, True, M.FeatureDesc(1, [3, 0, 5], 576, "bfloat16")),
     [codec.decode_status, codec.decode_to_drafter]),
    (M.Ready("verifier"), [codec.decode_status]),
    (M.Heartbeat("drafter", 0.125), [codec.decode_status]),
    (M.Error("drafter", "Traceback ...\nRuntimeError: boom"), [codec.decode_status]),
    (M.ProbeReply("drafter", 3, 4, 4, 17, [0, 1], 2, waiting=5), [codec.decode_status]),
    (M.ProbeReply("verifier", 3, 4, 4, 17, [1], 1), [codec.decode_status]),
]
DECODERS = [codec.decode_cmd, codec.decode_drafts, codec.decode_to_drafter, codec.decode_status]


def test_samples_cover_every_control_message():
    assert {type(m) for m, _ in SAMPLES} == set(M.CONTROL)


@pytest.mark.parametrize("msg,decoders", SAMPLES, ids=[type(m).__name__ for m, _ in SAMPLES])
def test_control_message_round_trip_on_its_sockets_only(msg, decoders):
    data = codec.encode(msg)
    raw = msgspec.msgpack.decode(data)
    assert isinstance(raw, list) and raw[0] == type(msg).__struct_config__.tag  # a tagged array, no key names
    for decode in DECODERS:
        if decode in decoders:
            back = decode(data)
            assert type(back) is type(msg) and back == msg
        else:
            with pytest.raises(ValueError):
                decode(data)


def test_payloads_round_trip_with_their_types():
    back = codec.decode_cmd(codec.encode(M.Add(REQ))).req
    assert back == REQ and isinstance(back.params, SamplingParams) and back.params.stop_token_ids == (3, 9)
    assert back.cache_tokens(6) == 3 + 12 + 6 + 1
    rows = codec.decode_status(codec.encode(VERDICT)).results
    assert [(r.rid, r.new_tokens, r.num_drafted, r.num_accepted, r.finish_reason) for r in rows] == \
        [(1, [4, 5, 6], 3, 2, None), (2, [8], 3, 0, "stop"), (3, [], 0, 0, "length")]
    for payload in (M.DraftsDesc(1, 3, 0, 0), M.FeatureDesc(0, [], 0, "float32"), ROWS[0], REQ):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(payload), type=type(payload)) == payload


def test_invalid_sampling_params_are_refused_on_decode():
    data = codec.encode(M.Add(REQ)).replace(b"\xa5top_k\x05", b"\xa5top_k\xff")  # top_k = -1
    with pytest.raises(ValueError, match="top_k"):
        codec.decode_cmd(data)


def test_worker_spec_pickles_and_takes_per_process_fields():
    cfg = M.WorkerConfig(mode="minedraft", budget=DraftBudget(3, True, 2, None), merge_on_zero=False,
                         kv_cache_tokens=4096, block_size=16, dtype="float32", target="/t", draft="/d", suffix=None,
                         hybrid_threshold=1.0, heartbeat_s=0.25)
    spec = M.WorkerSpec(cfg=cfg, addr=M.Addresses("ipc://a", "ipc://b", "ipc://c", "ipc://d"), eos=[2],
                        shm=["psm_1"], slot_nbytes=1024, features=False, feat_nbytes=0, feat_shm=[],
                        fault=["verifier", "verify", 4, "raise"])
    rank = msgspec.structs.replace(spec, device="cuda:1", cores=[2, 3],
                                   tp=M.TPRank("verifier", "target", 1, 2, "file:///x", 30.0))
    back = pickle.loads(pickle.dumps(rank))
    assert back == rank and back.tp.rank == 1 and spec.device == "cpu" and spec.tp is None
    assert getattr(back.cfg, back.tp.model) == "/t" and back.cfg.k == 3 and back.cfg.max_draft == 5


def test_worker_config_is_derived_from_the_engine_config():
    """One view, built in one place: the budget and the draft length follow the mode, Tetris and adaptive k."""
    auto = M.WorkerConfig.of(EngineConfig(mode="minedraft", k=3, tetris=True))
    assert (auto.k, auto.max_draft, auto.merge_on_zero, auto.draft) == (3, 5, True, EngineConfig().draft_model)
    alone = M.WorkerConfig.of(EngineConfig(mode="autoregressive", k=3, tetris=True))
    assert (alone.k, alone.max_draft, alone.budget.tetris, alone.merge_on_zero) == (0, 0, False, False)
    seq = M.WorkerConfig.of(EngineConfig(mode="sequential", k=3, adaptive_k=False))
    assert (seq.k, seq.merge_on_zero) == (3, False)
