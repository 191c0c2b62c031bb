"""The `minedraft` command line: help of every subcommand, keygen, bind refusal, and `generate` output equal to
Engine.generate's for the same greedy prompt."""

from __future__ import annotations

import asyncio
import os
import stat
import sys

import pytest

from minedraft.cli import main as cli
from minedraft.config import EngineConfig
from minedraft.engine.engine import Engine
from minedraft.serving.zmq.access import load_key

PROMPT = "The while statement is used for"


def _env() -> dict:
    return {**os.environ, "PYTHONIOENCODING": "utf-8", "TOKENIZERS_PARALLELISM": "false",
            "MINEDRAFT_TEST_THREADS": "1"}


@pytest.mark.parametrize("argv,expect", [
    ([], ["generate", "serve", "keygen", "bench"]),
    (["generate"], ["--max-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--k", "--mode", "--target",
                    "--draft", "default: 64", "default: auto", "bundled"]),
    (["serve"], ["--bind", "--allow-remote", "--curve-secret-key", "--curve-public-key", "--curve-client-keys",
                 "--max-message-bytes", "default: tcp://127.0.0.1:5555", "--max-tokens-limit"]),
    (["keygen"], ["--out-dir", "--name", "--force", "default: server"]),
])
def test_help_of_each_subcommand(argv, expect, capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main([*argv, "--help"])
    assert ei.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # undo line wrapping
    for word in expect:
        assert word in out, (word, out)


def test_every_option_has_help_and_a_default():
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in subs.choices.items():
        if name == "bench":
            continue
        text = p.format_help()
        for action in p._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, (name, action.dest)
        assert text.count("default") >= len([a for a in p._actions if a.option_strings]) - 1, name


def test_bench_forwards_its_arguments(monkeypatch):
    import types
    seen = {}
    fake = types.ModuleType("minedraft.bench.runner")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "minedraft.bench.runner", fake)
    import minedraft.bench
    monkeypatch.setattr(minedraft.bench, "runner", fake, raising=False)
    assert cli.main(["bench", "--help", "--modes", "a,b"]) == 0
    assert seen["argv"] == ["--help", "--modes", "a,b"]


def test_bench_help_reaches_the_real_bench(capsys):
    pytest.importorskip("minedraft.bench.runner")
    with pytest.raises(SystemExit) as ei:
        cli.main(["bench", "--help"])
    assert ei.value.code == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_keygen_writes_a_usable_keypair(tmp_path, capsys):
    assert cli.main(["keygen", "--out-dir", str(tmp_path), "--name", "srv"]) == 0
    secret, public = tmp_path / "srv.secret", tmp_path / "srv.public"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    import zmq
    assert zmq.curve_public(load_key(secret, "secret")) == load_key(public, "public")
    assert load_key(public, "public").decode() in capsys.readouterr().out
    assert cli.main(["keygen", "--out-dir", str(tmp_path), "--name", "srv"]) == 1  # no silent overwrite
    assert "--force" in capsys.readouterr().err
    assert cli.main(["keygen", "--out-dir", str(tmp_path), "--name", "srv", "--force"]) == 0


def test_serve_refuses_non_loopback_without_flag(capsys):
    assert cli.main(["serve", "--bind", "tcp://0.0.0.0:5599"]) == 2
    err = capsys.readouterr().err
    assert "--allow-remote" in err and "0.0.0.0" in err


def test_serve_reports_bad_model_path(capsys, tmp_path):
    assert cli.main(["serve", "--target", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_generate_rejects_bad_sampling_options(capsys, tiny_pair):
    assert cli.main(["generate", "x", "--top-p", "2", "--target", tiny_pair.target, "--draft", tiny_pair.draft]) == 2
    assert "--top-p must be in (0, 1]" in capsys.readouterr().err  # names the option typed


def _bundled() -> tuple[str, str] | None:
    from minedraft.config import DEFAULT_DRAFT, DEFAULT_TARGET
    ok = all(os.path.exists(os.path.join(d, "config.json")) for d in (DEFAULT_TARGET, DEFAULT_DRAFT))
    return (DEFAULT_TARGET, DEFAULT_DRAFT) if ok else None


async def test_generate_prints_engine_text(tiny_pair):
    """The command's stdout is exactly Engine.generate's text (plus a newline); the summary goes to stderr.
    With the bundled models present it runs with no model options at all (the out-of-the-box defaults)."""
    n, k = 40, 3
    bundled = _bundled()
    target, draft = bundled or (tiny_pair.target, tiny_pair.draft)
    models = [] if bundled else ["--target", target, "--draft", draft]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "minedraft", "generate", PROMPT, *models, "--max-tokens", str(n),
        "--ignore-eos", "--k", str(k), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=_env())
    communicate = asyncio.ensure_future(proc.communicate())
    cfg = EngineConfig(target=target, draft=draft, k=k, max_prompt_tokens=64, max_tokens_limit=n,
                       kv_cache_tokens=4096)
    async with Engine(cfg) as engine:  # starts while the command runs
        ref = await engine.generate(PROMPT, {"max_tokens": n, "ignore_eos": True})
    out, err = await asyncio.wait_for(communicate, 240)
    assert proc.returncode == 0, err.decode(errors="replace")
    assert len(ref.token_ids) == n
    assert out == (ref.text + "\n").encode("utf-8")
    summary = err.decode().strip().splitlines()[-1]
    assert summary.startswith(f"[minedraft] {n} tokens") and "tokens/s" in summary and "acceptance" in summary


def test_tetris_and_dynamic_flags_reach_the_config(tiny_pair):
    a = cli.build_parser().parse_args(["generate", "x", "--target", tiny_pair.target, "--draft", tiny_pair.draft,
                                       "--tetris", "--tetris-capacity", "5", "--tetris-extra", "3", "--dynamic"])
    cfg = cli._generate_config(a)
    assert (cfg.tetris, cfg.tetris_capacity, cfg.tetris_extra, cfg.adaptive_k) == (True, 5, 3, True)
    assert cfg.max_draft == cfg.k + 3
    plain = cli._generate_config(cli.build_parser().parse_args(["generate", "x", "--target", tiny_pair.target,
                                                                 "--draft", tiny_pair.draft]))
    assert (plain.tetris, plain.adaptive_k, plain.max_draft) == (False, True, plain.k)  # dynamic by default
    fixed = cli._generate_config(cli.build_parser().parse_args(["generate", "x", "--target", tiny_pair.target,
                                                                 "--draft", tiny_pair.draft, "--no-dynamic"]))
    assert fixed.adaptive_k is False


def test_python_dash_m_runs_the_cli():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "minedraft", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("minedraft"), (r.stdout, r.stderr)


def test_a_bad_option_is_one_line(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["generate", "hi", "--max-tokens", "0"])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and err.count("\n") == 1 and "--max-tokens: must be >= 1" in err
