"""A new row's first step drafts nothing, so the draft model's prefill of its prompt never comes before the
target's (issue 43: a slow draft prefill delayed the first token); the drafter process runs that prefill right
after sending the step, while the verifier prefills the target, and the row drafts from its second step."""

from __future__ import annotations

import asyncio

from conftest import engine_config

from minedraft.config import DEFAULT_DRAFT
from minedraft.drafting.drafter import Drafter
from minedraft.engine.engine import Engine
from minedraft.ipc.messages import NewRequest
from minedraft.runner.model_runner import ModelRunner
from minedraft.sampling_params import SamplingParams


class _Counting:
    """The runner, counting the positions each forward feeds."""

    def __init__(self, runner):
        self._r, self.fed = runner, []

    def forward(self, seq_ids, token_lists, *a, **kw):
        self.fed.append(sum(map(len, token_lists)))
        return self._r.forward(seq_ids, token_lists, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._r, name)


def _req(rid, n):
    return NewRequest(rid, list(range(5, 5 + n)), SamplingParams(max_tokens=8), seed=rid)


def test_first_step_drafts_nothing_and_feeds_nothing():
    runner = _Counting(ModelRunner.from_pretrained(DEFAULT_DRAFT, 4096, 16))
    d = Drafter(runner, max_draft=4)
    d.add(_req(1, 40))
    drafts, _ = d.draft([1], 4)
    assert drafts == [[]] and runner.fed == [] and runner.cache.length(1) == 0
    d.apply(1, 0, [7])
    drafts, _ = d.draft([1], 4)          # second step: the prompt and the first token, then its drafts
    assert len(drafts[0]) == 4 and runner.fed[0] == 41


def test_prefill_feeds_the_prompt_so_the_next_draft_feeds_only_the_verdict():
    runner = _Counting(ModelRunner.from_pretrained(DEFAULT_DRAFT, 4096, 16))
    d = Drafter(runner, max_draft=4)
    d.add(_req(1, 40))
    d.add(_req(2, 3))
    assert d.draft([1, 2], 4)[0] == [[], []]
    d.prefill([1, 2])
    assert runner.fed == [41] and runner.cache.length(1) == 39   # all but each prompt's last token
    d.apply(1, 0, [7])
    d.apply(2, 0, [9])
    drafts, _ = d.draft([1, 2], 4)
    assert [len(x) for x in drafts] == [4, 4] and runner.fed[1] == 4   # two new tokens per row


def test_through_the_engine_the_first_verdict_carries_no_drafts_and_the_next_do(tiny_pair):
    async def run():
        async with Engine(engine_config(tiny_pair, k=3, adaptive_k=False)) as engine:
            verdicts = []
            engine.scheduler.verdict_listeners.append(verdicts.append)
            r = await engine.generate("the class statement", SamplingParams(max_tokens=24, ignore_eos=True))
            return r, verdicts
    r, verdicts = asyncio.run(run())
    drafted = [sum(x.num_drafted for x in m.results) for m in verdicts if m.results]
    assert drafted[0] == 0 and all(d > 0 for d in drafted[1:-1]), drafted
    assert len(r.token_ids) == 24
