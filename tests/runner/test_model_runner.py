"""ModelRunner details not covered by the exactness tests (those compare whole generations with transformers)."""

from __future__ import annotations

import pytest
import torch

from minedraft.runner.model_runner import pad_three_rows


def test_three_token_rows_run_as_four_and_give_the_same_values(monkeypatch):
    """pad_three_rows: a CPU float32 Linear gets 3 rows as 4 (a zero row, dropped again: 3-row GEMMs run as three
    matrix-vector products, slower than a blocked 4-row one); other row counts pass through unchanged; the values
    equal the plain layer's to float32 rounding."""
    torch.manual_seed(0)
    lin, ref = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    ref.load_state_dict(lin.state_dict())
    pad_three_rows(lin)
    rows = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: rows.append(x.shape[-2]) or real(x, w, b))
    for n in (1, 2, 3, 4):
        x = torch.randn(1, n, 16)
        out = lin(x)
        assert out.shape == (1, n, 8)
        torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-6)
    assert rows == [1, 1, 2, 2, 4, 3, 4, 4]   # (padded layer, reference) per n: only 3 rows became 4


def test_model_runner_implements_the_runner_interface(tiny_pair):
    from minedraft.runner.interface import Runner, RunnerCache
    from minedraft.runner.model_runner import ModelRunner
    runner = ModelRunner.from_pretrained(tiny_pair.target, 256)
    assert isinstance(runner, Runner) and isinstance(runner.cache, RunnerCache)


def test_without_a_compiler_the_runner_warns_once_and_keeps_the_torch_path(tiny_pair, monkeypatch):
    """No C compiler: one RuntimeWarning, the torch path, the same logits as asking for that path outright."""
    from minedraft.runner import kernels
    from minedraft.runner.model_runner import ModelRunner, load_causal_lm
    model = load_causal_lm(tiny_pair.target)
    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    kernels.load.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="kernels unavailable"):
            runner = ModelRunner(model, 256)
    finally:
        kernels.load.cache_clear()
    assert runner.kernels is None
    plain = ModelRunner(model, 256, kernels=False)
    for r in (runner, plain):
        r.cache.allocate(0, 32)
    assert torch.equal(runner.forward([0], [[1, 2, 3]], 3), plain.forward([0], [[1, 2, 3]], 3))
