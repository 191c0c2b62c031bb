"""What the engine needs to start the workers, importable without torch: the processes' entry points (each
imports its worker module, and torch with it, only inside the new process) and each role's processes and cores.
The caller's process never loads torch or transformers (start-up: the workers import them at the same time)."""

from __future__ import annotations

from msgspec.structs import replace

from ..ipc.messages import TPRank, WorkerSpec


def drafter_main(spec: WorkerSpec) -> None:
    from .drafter_process import DrafterProcess
    DrafterProcess(spec, "drafter").run()


def verifier_main(spec: WorkerSpec) -> None:
    from .verifier_process import VerifierProcess
    VerifierProcess(spec, "verifier").run()


def leader_main(spec: WorkerSpec) -> None:
    from .tp_ranks import leader_main as main
    main(spec)


def follower_main(spec: WorkerSpec) -> None:
    from .tp_ranks import follower_main as main
    main(spec)


def rank_device(device: str, rank: int) -> str:
    """Rank r of a group based at cuda:i runs on cuda:i+r; on CPU every rank is 'cpu' (pinned to a core)."""
    if not device.startswith("cuda"):
        return device
    import torch
    base = int(device.split(":")[1]) if ":" in device else 0
    n = torch.cuda.device_count()
    if base + rank >= n:
        raise ValueError(f"tensor-parallel rank {rank} based at {device} needs cuda:{base + rank}; "
                         f"{n} GPU(s) visible")
    return f"cuda:{base + rank}"


def split_cores(cores: list[int], world: int) -> list[list[int]]:
    """Rank r's share of a role's cores: disjoint contiguous chunks when there are enough, else one core each,
    round-robin (ranks then share cores)."""
    if len(cores) < world:
        return [[cores[r % len(cores)]] for r in range(world)]
    bounds = [r * len(cores) // world for r in range(world + 1)]
    return [cores[bounds[r]:bounds[r + 1]] for r in range(world)]


def role_processes(mpc, role: str, spec: WorkerSpec, world: int, cores: list[int], init: str, timeout_s: float):
    """The processes of one role (drafter or verifier): rank 0 first, then the followers. world == 1 is the
    plain worker on all the role's cores."""
    if world == 1:
        main = drafter_main if role == "drafter" else verifier_main
        return [mpc.Process(target=main, name=f"minedraft-{role}", daemon=True, args=(replace(spec, cores=cores),))]
    procs = []
    for r, rank_cores in enumerate(split_cores(cores, world)):
        tp = TPRank(role, "target" if role == "verifier" else "draft", r, world, init, timeout_s)
        s = replace(spec, device=rank_device(spec.device, r), cores=rank_cores, tp=tp)
        procs.append(mpc.Process(target=leader_main if r == 0 else follower_main, daemon=True,
                                 name=f"minedraft-{role}" + (f"-rank{r}" if r else ""), args=(s,)))
    return procs
