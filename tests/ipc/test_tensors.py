"""Draft slots in shared memory: drafts and probabilities round-trip; empty drafts (autoregressive) skip the slot."""

from __future__ import annotations

import pytest
import torch

from minedraft.ipc.messages import DraftsDesc
from minedraft.ipc.shm import create_shm, destroy_shm, slot_nbytes
from minedraft.ipc.tensors import DraftSlots


def test_slots_round_trip_and_empty_drafts_leave_the_slot_alone():
    shm = create_shm(2, slot_nbytes(4, 3, 10))
    try:
        producer, consumer = DraftSlots.attach_shm([s.name for s in shm]), DraftSlots.attach_shm([s.name for s in shm])
        q = torch.rand(2, 3, 10)
        desc = producer.write(1, [[1, 2, 3], [4, 5, 6]], q)
        drafts, q2 = consumer.read(desc)
        assert drafts == [[1, 2, 3], [4, 5, 6]] and torch.equal(q2, q)
        before = bytes(shm[1].buf[:64])
        desc = producer.write(1, [[], [], []], None)  # k = 0: nothing to store
        assert desc == DraftsDesc(slot=1, rows=3, width=0, vocab=0)
        assert bytes(shm[1].buf[:64]) == before
        assert consumer.read(desc) == ([[], [], []], None)
        del drafts, q2
        producer.close()
        consumer.close()
    finally:
        destroy_shm(shm)


def test_feature_slots_round_trip_ragged_rows():
    """A verdict's features: rows of different lengths (0 included) come back as separate copies, in order and in
    their dtype; a verdict bigger than the slot is refused, not written past its end."""
    from minedraft.ipc.shm import feature_slot_nbytes
    from minedraft.ipc.tensors import FeatureSlots

    from minedraft.config import EngineConfig
    assert feature_slot_nbytes(EngineConfig(max_batch_size=2, max_prompt_tokens=64, max_tokens_limit=32, k=3),
                               8) == 2 * (64 + 32 + 3 + 1) * 8 * 4  # the rows' lives, not the 65,536-token cache
    cfg = EngineConfig(max_batch_size=4, max_prompt_tokens=8, max_tokens_limit=8, kv_cache_tokens=32,
                       block_size=2, k=1)
    assert feature_slot_nbytes(cfg, 8) == 32 * 8 * 4  # here the cache is the tighter bound
    shm = create_shm(2, 10 * 8 * 4)
    try:
        names = [s.name for s in shm]
        producer, consumer = FeatureSlots.attach_shm(names), FeatureSlots.attach_shm(names)
        rows = [torch.randn(3, 8), torch.empty(0, 8), torch.randn(5, 8)]
        desc = producer.write(1, rows)
        assert desc.counts == [3, 0, 5]
        got = consumer.read(desc)
        assert [g.shape[0] for g in got] == [3, 0, 5]
        assert torch.equal(got[0], rows[0]) and torch.equal(got[2], rows[2])
        producer.write(1, [torch.zeros(8, 8)])  # the slot is reused: what was read must not change
        assert torch.equal(got[2], rows[2])
        half = [torch.randn(2, 8, dtype=torch.bfloat16)]
        back = consumer.read(producer.write(0, half))
        assert back[0].dtype == torch.bfloat16 and torch.equal(back[0], half[0])
        assert [g.shape[0] for g in consumer.read(producer.write(0, [torch.empty(0, 8)] * 2))] == [0, 0]
        with pytest.raises(RuntimeError, match="exceed the feature slot"):
            producer.write(0, [torch.randn(11, 8)])
        del got, back
        producer.close()
        consumer.close()
    finally:
        destroy_shm(shm)
