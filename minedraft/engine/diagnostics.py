"""Checks that something is really gone: used by the soak script and the tests to prove clean shutdowns."""

from __future__ import annotations

import os
from multiprocessing import shared_memory


def process_alive(pid: int) -> bool:
    """True while pid runs; a zombie (exited, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def shm_exists(name: str) -> bool:
    try:
        seg = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return False
    seg.close()
    return True
