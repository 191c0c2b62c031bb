"""Draft slots in shared memory: drafts and probabilities round-trip; empty drafts (autoregressive) skip the slot."""

from __future__ import annotations

import torch

from minedraft.ipc.tensors import DraftSlots, create_shm, destroy_shm, slot_nbytes


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
        assert desc == {"slot": 1, "B": 3, "k": 0, "V": 0}
        assert bytes(shm[1].buf[:64]) == before
        assert consumer.read(desc) == ([[], [], []], None)
        del drafts, q2
        producer.close()
        consumer.close()
    finally:
        destroy_shm(shm)
