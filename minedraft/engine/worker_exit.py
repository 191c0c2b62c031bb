"""One sentence on why a worker process ended, for the ERROR line the engine logs when one dies: a supervisor's
log then says which worker went, how (exit code or signal) and what to change, instead of nothing."""

from __future__ import annotations

import signal

KV_HINT = "lower --kv-cache-memory-fraction or --kv-cache-tokens (EngineConfig.kv_cache_memory_fraction / " \
          "kv_cache_tokens), or free memory"


def describe_exit(name: str, pid: int | None, exitcode: int) -> str:
    """'worker minedraft-drafter (pid 123) was killed by SIGKILL: most likely the kernel's out-of-memory killer
    (see dmesg); lower ...'. A negative exit code is the signal that ended the process (multiprocessing's rule)."""
    who = f"worker {name}" + (f" (pid {pid})" if pid is not None else "")
    if exitcode >= 0:
        return f"{who} exited with code {exitcode}" + (
            ": it crashed (its traceback, if any, is logged above)" if exitcode else " while the engine ran")
    try:
        sig = signal.Signals(-exitcode).name
    except ValueError:
        sig = f"signal {-exitcode}"
    if -exitcode == signal.SIGKILL:
        return (f"{who} was killed by SIGKILL: most likely the kernel's out-of-memory killer (check `dmesg`); "
                f"{KV_HINT}")
    if -exitcode in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT):
        return f"{who} was killed by {sig}: it crashed in native code (torch or a kernel library)"
    return f"{who} was killed by {sig} (sent from outside minedraft)"
