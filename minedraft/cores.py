"""Which CPU cores each worker runs on, and how many torch threads it uses.

Default rule (when EngineConfig.draft_cores / target_cores are None), over the cores this process may use
(os.sched_getaffinity):
  * minedraft: drafter and verifier run at the same time, so they get disjoint halves; the verifier gets the odd
    core, because its forward (k + 1 tokens per row through the larger model) is the heavier one. The remaining
    imbalance between Td and Tv is what k (or adaptive k) tunes, so an even split keeps that knob useful.
  * sequential: drafter and verifier take turns (draft, wait, verify), so both get every core; a disjoint split
    would leave half of them idle at every moment.
  * autoregressive: the verifier gets every core; the drafter runs no model (it only relays empty drafts) and
    shares them: measured with scripts/bench/step_overhead.py, a drafter on another core than the verifier's, beside
    the busy scheduler, more than doubled the idle gap between two verify steps. The same rule applies in minedraft
    mode to suffix drafts alone (draft="suffix", EngineConfig.core_mode): that drafter runs no model either.
A worker pins itself to its set (sched_setaffinity) and sets torch's intra-op threads to its size (see threads_for).
"""

from __future__ import annotations

import contextlib
import os


THREADS_ENV = "MINEDRAFT_WORKER_THREADS"
# OpenMP threads (torch's intra-op pool, GNU libgomp) spin while they wait for each other by default. On a host
# where another process holds a core, a spinning thread burns the time slices its preempted partner needs, and a
# 2-thread forward ran 7-10x slower than a 1-thread one (docs/BENCHMARKS.md "Threads on a loaded host"); passive
# threads sleep instead, and 2 passive threads were no slower than 1. The user's own setting wins.
WAIT_POLICY = ("OMP_WAIT_POLICY", "PASSIVE")


def prefer_passive_wait() -> None:
    """Make OpenMP threads of this process (and its children) wait passively, unless the user chose a policy. Only
    effective before torch is first imported: the OpenMP runtime reads it once, when it loads."""
    os.environ.setdefault(*WAIT_POLICY)


@contextlib.contextmanager
def worker_environment():
    """Around spawning workers: they start with the passive wait policy (unless the user set one), whatever this
    process's own torch was loaded with; this process's environment is restored afterwards."""
    name, value = WAIT_POLICY
    added = name not in os.environ
    if added:
        os.environ[name] = value
    try:
        yield
    finally:
        if added:
            os.environ.pop(name, None)


def threads_for(cores: list[int] | None) -> int:
    """torch intra-op threads for a worker on these cores: one per core, capped by $MINEDRAFT_WORKER_THREADS if set.

    The cap is for shared machines: with more runnable threads than free cores a multi-threaded GEMM waits at
    every barrier for its preempted threads (the test suite sets it to 1; see docs/BENCHMARKS.md)."""
    n = len(cores) if cores else 1
    cap = os.environ.get(THREADS_ENV)
    return max(1, min(n, int(cap))) if cap else n


def available_cores() -> list[int]:
    """The cores this process may run on (all online cores where affinity is not supported)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def parse_cores(text: str) -> list[int]:
    """'0', '1-3', '0,2,4-5' -> sorted core ids. Raises ValueError on anything else."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"bad core list {text!r}: expected ids and ranges like 0,2-3") from None
        if a < 0 or b < a:
            raise ValueError(f"bad core range {part!r} in {text!r}")
        out.update(range(a, b + 1))
    return sorted(out)


def default_split(cores: list[int], mode: str) -> tuple[list[int], list[int]]:
    """(draft cores, target cores) by the rule in the module docstring."""
    cores = sorted(cores)
    if mode != "minedraft" or len(cores) == 1:
        return list(cores), list(cores)  # take turns (or nothing else to share with)
    half = len(cores) // 2
    return cores[:half], cores[half:]


def check_cores(name: str, cores, allowed: list[int]) -> list[int]:
    """A validated, sorted copy of one core list; ValueError naming the field otherwise."""
    if isinstance(cores, str):
        cores = parse_cores(cores)
    if not isinstance(cores, (list, tuple, set, frozenset)) or not cores:
        raise ValueError(f"{name} must be a non-empty list of CPU core ids, got {cores!r}")
    if any(isinstance(c, bool) or not isinstance(c, int) for c in cores):
        raise ValueError(f"{name} must hold integer core ids, got {cores!r}")
    outside = sorted(set(cores) - set(allowed))
    if outside:
        raise ValueError(f"{name} has cores {outside} this process may not use (allowed: {allowed})")
    return sorted(set(cores))


def resolve(draft_cores, target_cores, mode: str, allowed: list[int] | None = None) -> tuple[list[int], list[int]]:
    """The (draft, target) core sets a config asks for, defaults filled in and checked.

    In minedraft mode the two sets must be disjoint (both workers compute at once; shared cores would make them
    fight); in the other modes they take turns, so sets may overlap. Given only one set, the other worker gets
    the remaining allowed cores in minedraft mode, and the same set otherwise (in autoregressive mode the drafter
    only relays empty drafts: on the verifier's cores its wake-ups cost a context switch, not a cross-core hop
    behind the scheduler)."""
    allowed = sorted(allowed if allowed is not None else available_cores())
    d = check_cores("draft_cores", draft_cores, allowed) if draft_cores is not None else None
    t = check_cores("target_cores", target_cores, allowed) if target_cores is not None else None
    if d is None and t is None:
        return default_split(allowed, mode)
    if mode == "minedraft":
        if d is None:
            d = [c for c in allowed if c not in t]
        elif t is None:
            t = [c for c in allowed if c not in d]
        if not d or not t:
            raise ValueError(f"{'draft_cores' if not d else 'target_cores'}: no allowed core is left for it "
                             f"(allowed: {allowed}); give both sets explicitly")
        common = sorted(set(d) & set(t))
        if common:
            raise ValueError(f"draft_cores and target_cores share cores {common}; in minedraft mode both workers "
                             "compute at the same time, so the sets must be disjoint")
    else:  # given one set, the other worker shares it (they take turns)
        d = d if d is not None else t
        t = t if t is not None else d
    return d, t


def format_cores(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the form parse_cores reads)."""
    out, cores = [], sorted(cores)
    i = 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(out)


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags (Linux /proc/cpuinfo); None where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def int4_kernel_is_fast() -> bool:
    """Whether torch's packed int4 CPU matmul beats float32 here: on AVX2-only x86 hosts it is slower (a 930-token
    prefill matmul 43 ms against 22.6 ms, a one-row matmul 147 us against 121: /work/shared findings, docs/
    BENCHMARKS.md "Self-drafts"); with AVX-512 it ran at a third of float32's cost. Unknown flags: assume fast."""
    flags = cpu_flags()
    if flags is None or "avx2" not in flags:  # not an x86 host we measured (or flags unreadable)
        return True
    return "avx512f" in flags
