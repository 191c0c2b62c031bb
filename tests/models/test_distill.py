"""The training scripts' data (minedraft/models/distill.py): a target's greedy answers, their soft labels and features."""

from __future__ import annotations

import torch

from minedraft.models.distill import TOPK, greedy_rows
from minedraft.runner.model_runner import ModelRunner


def test_greedy_rows_are_the_targets_greedy_answers(tiny_pair):
    from transformers import AutoModelForCausalLM

    prompts = [[5, 9, 13, 2], [7, 3], [11, 4, 8]]
    max_new = 6
    runner = ModelRunner.from_pretrained(tiny_pair.target, 4096)
    rows = greedy_rows(runner, prompts, max_new, eos=None, features=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_pair.target, local_files_only=True).eval()
    for p, r in zip(prompts, rows):
        want = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False,
                              pad_token_id=tiny_pair.eos_token_id)[0, len(p):].tolist()
        assert r["prompt"] == p and len(r["gen"]) == max_new
        assert r["gen"][:len(want)] == want  # generate stops at EOS; with eos=None the rows go on
        n = len(r["gen"])
        assert r["top_i"].shape == r["top_v"].shape == (n, TOPK)
        assert r["top_i"][:, 0].tolist() == r["gen"]  # the top soft label is the greedy token
        assert torch.all(r["top_v"][:, :-1] >= r["top_v"][:, 1:])  # sorted log-probabilities
        assert r["feat"].shape == (len(p) + n - 1, model.config.hidden_size)  # one per fed position
    assert runner.cache.allocator.num_free == runner.cache.num_blocks  # every row's blocks given back
