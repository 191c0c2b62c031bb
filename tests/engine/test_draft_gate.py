"""SuffixGate: dynamic speculation for suffix drafts alone weighs what a drafted token saves against its cost."""

import random

import pytest

from minedraft.engine.draft_gate import SuffixGate


def _run(gate, steps, rows, plain_s, per_token_s, acceptance, seed=0, bursty=False):
    """Feed `steps` verdicts: the verifier takes plain_s + per_token_s x drafts; each row drafts 0-6 tokens (ragged,
    as suffix drafts are) and keeps each with probability `acceptance` (bursty: copy stretches of 20 steps that
    keep 90%, free text between that keeps 5%)."""
    rng = random.Random(seed)
    for i in range(steps):
        k = gate.choose(rows)
        acc = acceptance if not bursty else (0.9 if (i // 20) % 3 == 0 else 0.05)
        drafted = accepted = rejections = 0
        for _ in range(rows):
            d = rng.randint(0, k) if k else 0
            n = 0
            while n < d and rng.random() < acc:
                n += 1
            drafted, accepted, rejections = drafted + d, accepted + n, rejections + (n < d)
        noise = 1 + 0.1 * (rng.random() - 0.5)
        gate.observe(k, 1e-5 * drafted if k else None, (plain_s * rows + per_token_s * drafted) * noise, accepted,
                     rejections, rows=rows, step_rows=rows, drafted=drafted)
    return gate


def test_cheap_verification_drafts_throughout_even_when_the_copies_come_in_bursts():
    """Memory-bound verify (a drafted token costs a twentieth of a plain token) and bursty acceptance: a probe
    in a free-text stretch must not switch drafting off (AdaptiveK's short probes did, at B = 1)."""
    gate = _run(SuffixGate(6), 600, rows=1, plain_s=0.040, per_token_s=0.002, acceptance=0.0, bursty=True)
    assert gate.history.count(0) == 0, gate.history
    assert gate.drafting_pays(1)


@pytest.mark.parametrize("acceptance", [0.1, 0.3])
def test_costly_verification_with_low_acceptance_turns_drafting_off(acceptance):
    """Compute-bound verify at a large batch (a drafted token costs as much as 0.6 of a plain one) and drafts that
    are seldom kept: the gate runs plain decoding, except for short probes that keep the acceptance current."""
    gate = _run(SuffixGate(6), 1200, rows=16, plain_s=0.005, per_token_s=0.003, acceptance=acceptance)
    tail = gate.history[-400:]
    assert tail.count(0) > 0.95 * len(tail), tail
    # probes: four steps at a time, the first 64 steps after drafting stopped, then (this far from paying) every 512
    after = gate.history[gate.history.index(0):]
    assert 4 <= after.count(6) <= 12, after.count(6)
    assert gate.drafting_pays(16) is False


def test_drafting_resumes_when_the_probes_see_the_acceptance_rise():
    """Plain decoding while drafts were seldom kept; then the text turns to copying: the next probe's own drafts
    pay, replace the older acceptance, and drafting resumes."""
    gate = _run(SuffixGate(6, explore_every=16), 400, rows=16, plain_s=0.005, per_token_s=0.002, acceptance=0.1)
    assert gate.k == 0 or gate.history[-8:].count(0) >= 4
    _run(gate, 600, rows=16, plain_s=0.005, per_token_s=0.002, acceptance=0.97, seed=1)
    assert gate.history[-100:].count(6) == 100, gate.history[-100:]


def test_the_cost_is_the_load_s_own():
    """The same acceptance pays at one row (memory-bound) and not at 32 (compute-bound): costs are kept per load."""
    gate = SuffixGate(6)
    _run(gate, 300, rows=1, plain_s=0.040, per_token_s=0.002, acceptance=0.5)
    _run(gate, 300, rows=32, plain_s=0.004, per_token_s=0.004, acceptance=0.5, seed=2)
    assert gate.drafting_pays(1) and gate.drafting_pays(32) is False
    assert gate.choose(1) == 6


def test_the_engine_gates_suffix_drafts_alone_in_sequential_mode_only():
    from types import SimpleNamespace

    from minedraft.config import EngineConfig
    from minedraft.engine.dynamic import AdaptiveK, DynamicSpeculation
    sched = SimpleNamespace(running={}, set_k=lambda k: None)
    seq = DynamicSpeculation(EngineConfig(draft="suffix", k=5, mode="sequential"), sched).controller
    assert isinstance(seq, SuffixGate) and seq.levels == (0, 5) and seq.k == 5   # starts drafting
    two = DynamicSpeculation(EngineConfig(draft="suffix", k=5, mode="minedraft"), sched).controller
    assert isinstance(two, AdaptiveK) and two.levels == (0, 5)
