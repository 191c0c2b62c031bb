"""The command line as a new user meets it: a light `import minedraft`, instant help and argument errors that
name the option typed, and Ctrl-C at any moment ending with one line and exit status 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from minedraft.cli import main as cli

HEAVY = ("torch", "transformers")


def _env() -> dict:
    return {**os.environ, "PYTHONIOENCODING": "utf-8", "TOKENIZERS_PARALLELISM": "false"}


def test_import_minedraft_does_not_import_torch():
    code = ("import sys, minedraft, minedraft.cli.main; minedraft.cli.main.build_parser(); "
            f"print([m for m in {HEAVY!r} if m in sys.modules]); "
            "from minedraft import SamplingParams, EngineConfig, MinedraftError; "
            "print([m for m in ('torch',) if m in sys.modules]); "
            "print(minedraft.Engine.__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["[]", "[]", "Engine False"]  # the engine module neither: workers do


@pytest.mark.parametrize("argv,rc,expect", [
    (["--help"], 0, "generate"),
    (["serve", "--help"], 0, "--bind"),
    (["generate", ""], 2, "PROMPT is empty"),
    (["generate", "x", "--k", "0"], 2, "--k must be in 1..16"),
    (["generate", "x", "--top-p", "2"], 2, "--top-p must be in (0, 1]"),
    (["generate", "x", "--max-tokens", "x"], 2, "--max-tokens"),
    (["serve", "--bind", "tcp://0.0.0.0:5599"], 2, "--allow-remote"),
    (["serve", "--bind", "nonsense"], 2, "cannot parse bind endpoint"),
])
def test_help_and_argument_errors_answer_at_once(argv, rc, expect):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "minedraft", *argv], capture_output=True, text=True,
                         env=_env(), timeout=120)
    took = time.monotonic() - t0
    assert out.returncode == rc, out.stderr
    assert expect in out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert took < 2.0, f"{argv} took {took:.1f} s"  # interpreter start + argparse; torch alone takes seconds


def test_k_is_ignored_in_autoregressive_mode():
    a = cli.build_parser().parse_args(["generate", "x", "--k", "0", "--mode", "autoregressive"])
    cfg = cli._generate_config(a)
    assert not cfg.speculative and cfg.max_draft == 0
    a = cli.build_parser().parse_args(["generate", "x", "--k", "17"])
    with pytest.raises(ValueError, match="--k must be in 1..16"):
        cli._generate_config(a)


def test_bad_model_directory_answers_before_loading(tmp_path, capsys):
    t0 = time.monotonic()
    assert cli.main(["generate", "x", "--target", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"target model directory {tmp_path} has no config.json" in err
    assert time.monotonic() - t0 < 5


def _group_size(pgid: int) -> int:
    """Processes in process group pgid (the command and the workers it spawned)."""
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    n += int(f.read().rsplit(")", 1)[1].split()[2]) == pgid
            except (OSError, ValueError, IndexError):
                pass  # exited meanwhile
    return n


def _interrupt(argv: list[str], when) -> tuple[int, str, str]:
    """Run the CLI in its own session and send SIGINT to its whole process group, as a terminal's Ctrl-C does,
    once when(pid, seconds, stdout_so_far) is true."""
    # SIGINT as a terminal leaves it (a shell's background job would inherit it ignored, and never see Ctrl-C)
    proc = subprocess.Popen([sys.executable, "-m", "minedraft", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env(), start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.set_blocking(proc.stdout.fileno(), False)
    out = b""
    t0 = time.monotonic()
    try:
        while not when(proc.pid, time.monotonic() - t0, out):
            chunk = proc.stdout.read()
            out += chunk or b""
            assert proc.poll() is None, (proc.returncode, out, proc.stderr.read())
            assert time.monotonic() - t0 < 120
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # nothing of the group (workers) outlives it
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("worker processes outlived the interrupted command")
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


@pytest.mark.parametrize("moment", ["importing", "starting", "streaming"])
def test_ctrl_c_at_any_moment(tiny_pair, moment):
    argv = ["generate", "the class statement", "--target", tiny_pair.target, "--draft", tiny_pair.draft,
            "--max-tokens", "400", "--ignore-eos"]
    when = {"importing": lambda pid, t, out: t > 0.3,     # inside main, importing / checking models
            # the workers are spawned and loading, nothing streamed yet (start-up takes ~4 s on a quiet box: a
            # fixed time could fall after the whole command)
            "starting": lambda pid, t, out: not out and _group_size(pid) > 1,
            "streaming": lambda pid, t, out: len(out) > 0}[moment]
    rc, out, err = _interrupt(argv, when)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 130, err
    assert lines == ["minedraft: interrupted"], err


@pytest.mark.parametrize("sig,rc", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_serve_stops_promptly_on_a_signal(tiny_pair, sig, rc):
    proc = subprocess.Popen([sys.executable, "-m", "minedraft", "serve", "--bind", "tcp://127.0.0.1:*",
                             "--target", tiny_pair.target, "--draft", tiny_pair.draft, "--log-level", "error"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), start_new_session=True)
    try:
        assert "listening on" in proc.stdout.readline().decode()
        t0 = time.monotonic()
        os.killpg(proc.pid, sig)  # SIGINT to the group, as Ctrl-C in a terminal; SIGTERM likewise reaches all
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == rc, err
    assert took < 2.0, f"serve took {took:.2f} s to exit"  # about 3 s of interpreter teardown before
    lines = [ln for ln in err.decode().splitlines() if ln.strip()]
    assert lines == (["minedraft: interrupted"] if sig == signal.SIGINT else []), lines


def test_bind_refusal_answers_before_torch_loads():
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "minedraft", "serve", "--bind", f"tcp://127.0.0.1:{port}"],
                             capture_output=True, text=True, env=_env(), timeout=120)
        took = time.monotonic() - t0
    assert out.returncode == 1 and "cannot bind" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert took < 2.0, f"bind refusal took {took:.1f} s"
