"""Model directories are checked in the parent before any worker is spawned: one sentence naming the directory."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest

from minedraft.config import EngineConfig
from minedraft.engine.engine import Engine
from minedraft.models.check import ModelDirError, check_model_dir, check_pair


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_good_pair_passes(tiny_pair):
    tok, vocab, eos = check_pair(tiny_pair.target, tiny_pair.draft)
    assert vocab == tiny_pair.vocab_size and tiny_pair.eos_token_id in eos and tok is not None


def test_empty_directory(tmp_path):
    with pytest.raises(ModelDirError, match=f"target model directory {re.escape(str(tmp_path))} has no "
                                            "config.json"):
        check_model_dir(str(tmp_path), "target")


def test_missing_directory(tmp_path):
    with pytest.raises(ModelDirError, match="does not exist"):
        check_model_dir(str(tmp_path / "nope"), "draft")


def test_unsupported_model_type(tiny_pair, tmp_path):
    d = _copy(tiny_pair.target, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelDirError, match=rf"{re.escape(d)} is of type 'gpt2', which minedraft cannot run"):
        check_model_dir(d, "target")


def test_config_not_json(tiny_pair, tmp_path):
    d = _copy(tiny_pair.target, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(ModelDirError, match="cannot be read as JSON"):
        check_model_dir(d, "target")


def test_no_weights(tiny_pair, tmp_path):
    d = _copy(tiny_pair.target, tmp_path / "m")
    for f in (tmp_path / "m").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelDirError, match=rf"{re.escape(d)} has no weights"):
        check_model_dir(d, "target")


@pytest.mark.parametrize("keep", [0.5, 0.999, 4])
def test_truncated_weights(tiny_pair, tmp_path, keep):
    d = _copy(tiny_pair.target, tmp_path / "m")
    (w,) = (tmp_path / "m").glob("*.safetensors")
    data = w.read_bytes()
    w.write_bytes(data[:int(len(data) * keep)] if keep < 1 else data[:keep])
    with pytest.raises(ModelDirError, match=rf"weights file {re.escape(str(w))} is damaged or truncated"):
        check_model_dir(d, "target")


def test_tokenizer_missing(tiny_pair, tmp_path):
    d = _copy(tiny_pair.target, tmp_path / "m")
    for f in (tmp_path / "m").glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ModelDirError, match=rf"cannot load a tokenizer from target model directory {re.escape(d)}"):
        check_pair(d, tiny_pair.draft)


async def test_engine_refuses_before_spawning(tiny_pair, tmp_path):
    """An empty target directory fails Engine start quickly, naming it, and no worker process is started."""
    engine = Engine(EngineConfig(target=str(tmp_path), draft=tiny_pair.draft, kv_cache_tokens=4096))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=re.escape(str(tmp_path))):
        await engine._start()
    assert engine.procs == [] and time.monotonic() - t0 < 10
    await engine.shutdown()
