"""The engine tells a CUDA build of torch from a CPU one without importing torch (the caller's start-up)."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest

from minedraft.engine import engine as engine_mod


@pytest.mark.parametrize("line,driver,expect", [
    ("cuda: Optional[str] = None", True, False),        # the CPU wheel
    ("cuda: Optional[str] = '12.8'", True, True),       # a CUDA wheel on a machine with the driver
    ("cuda = '12.8'", True, True),
    ("cuda: Optional[str] = '12.8'", False, False),     # a CUDA wheel, no driver: no GPU to use
])
def test_cuda_build_read_from_torch_version_file(tmp_path, monkeypatch, line, driver, expect):
    (tmp_path / "version.py").write_text(f"from typing import Optional\n__version__ = '2.13.0'\n{line}\n")
    origin = str(tmp_path / "__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: SimpleNamespace(origin=origin))
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists",
                        lambda p: driver if p == "/proc/driver/nvidia/version" else real_exists(p))
    assert engine_mod._torch_has_cuda() is expect


def test_never_misses_a_gpu_torch_sees():
    """False means CPU without asking torch; True only means torch is asked."""
    import torch
    assert engine_mod._torch_has_cuda() or not torch.cuda.is_available()
