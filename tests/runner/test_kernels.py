"""The C kernels (minedraft/runner/kernels.c) give the same bits for any number of rows and on every instruction
set: the machine's own build, an AVX2 build, a plain-C build, and the scalar `fmaf` path forced at run time."""

from __future__ import annotations

import platform

import pytest
import torch

from minedraft.runner import kernels
from minedraft.runner.kernel_forward import KernelModel, pack
from minedraft.runner.model_runner import ModelRunner, load_causal_lm


def _builds():
    """(name, library, forced scalar) for every build this CPU can run."""
    out = [("native", kernels.load(), False), ("native-scalar", kernels.load(), True)]
    if platform.machine() in ("x86_64", "AMD64"):
        flags = kernels._cpu_flags().split()
        if "avx2" in flags and "fma" in flags:
            out.append(("avx2", kernels.load("x86-64-v3"), False))
        out.append(("plain-c", kernels.load("x86-64"), False))
    return out


@pytest.fixture(autouse=True)
def _vector_path_after():
    yield
    kernels.load().md_force_scalar(0)


def _matmul(lib, scalar, x, w, bias=None):
    lib.md_force_scalar(int(scalar))
    wp = pack(w, lib.md_panel_width())
    y = torch.empty(x.shape[0], w.shape[0])
    lib.md_matmul(x.data_ptr(), x.shape[1], x.shape[0], x.shape[1], wp.data_ptr(), w.shape[0],
                  None if bias is None else bias.data_ptr(), y.data_ptr(), w.shape[0])
    lib.md_force_scalar(0)
    return y


def test_matmul_rows_are_independent_of_batch_and_isa():
    torch.manual_seed(0)
    w, x, b = torch.randn(203, 96), torch.randn(13, 96), torch.randn(203)  # 203: a partial last panel
    ref = _matmul(kernels.load(), False, x, w, b)
    torch.testing.assert_close(ref, x @ w.T + b, rtol=1e-5, atol=1e-4)
    for name, lib, scalar in _builds():
        for m in range(1, 14):
            assert torch.equal(_matmul(lib, scalar, x[:m], w, b), ref[:m]), (name, m)
        assert torch.equal(_matmul(lib, scalar, x[7:8], w, b), ref[7:8]), name  # a row alone, from mid-batch


def test_norm_and_exp_match_torch_and_agree_across_isas():
    torch.manual_seed(1)
    x, w = torch.randn(5, 200) * 3, torch.randn(200)
    e = torch.linspace(-110, 88, 4001)
    outs = []
    for name, lib, scalar in _builds():
        lib.md_force_scalar(int(scalar))
        y, ex = torch.empty_like(x), torch.empty_like(e)
        lib.md_rmsnorm(x.data_ptr(), 200, 5, w.data_ptr(), 200, 1e-6, y.data_ptr(), 200)
        lib.md_exp(e.data_ptr(), ex.data_ptr(), e.numel())
        lib.md_force_scalar(0)
        outs.append((name, y, ex))
    ref_norm = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(outs[0][1], ref_norm, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[0][2], torch.exp(e), rtol=3e-7, atol=1e-38)
    for name, y, ex in outs[1:]:
        assert torch.equal(y, outs[0][1]) and torch.equal(ex, outs[0][2]), name


def test_whole_model_gives_the_same_bits_on_every_isa(tiny_pair):
    """The Qwen2 test model (q/k/v biases, GQA) through each build: prefill and a 3-token step, bitwise equal."""
    model = load_causal_lm(tiny_pair.qwen2)
    results = {}
    for name, lib, scalar in _builds():
        runner = ModelRunner(model, 512, 16, kernels=False)
        runner.kernels = KernelModel(runner, lib)
        lib.md_force_scalar(int(scalar))
        runner.cache.allocate(0, 64)
        first = runner.forward([0], [list(range(3, 40))], 2)
        second = runner.forward([0], [[5, 9, 11]], 3)
        lib.md_force_scalar(0)
        results[name] = (first, second)
    ref = results.pop("native")
    for name, (a, b) in results.items():
        assert torch.equal(a, ref[0]) and torch.equal(b, ref[1]), name
