"""Settings vLLM's CPU backend needs on a small machine (DESIGN.md lesson 8).

Applied only when the user has not set them: the KV cache size and one explicit core list per
worker (TP x PP ranks). The binding is recomputed for every engine, so engines of different
world sizes can be started one after another in the same process.
"""

from __future__ import annotations

import os

KV_CACHE_GIB = "1"
_SETTINGS = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")
# Values vinterp set (and a child process inherited) are not the user's: the child recomputes
# them for its own engines (a TP=2 script started from a process whose last engine had one
# worker would otherwise inherit a one-worker binding).
_OURS = "VINTERP_CPU_SETTINGS"
_USER_ENV = {
    k: os.environ.get(k) for k in _SETTINGS if k not in os.environ.get(_OURS, "").split(",")
}


def core_groups(count: int, cpus: list[int] | None = None) -> list[list[int]]:
    """`count` core lists of this process's cores (or `cpus`): contiguous, near-equal groups;
    with more groups than cores, groups share cores round-robin (slow, but it starts)."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if count >= len(cpus):
        return [[cpus[rank % len(cpus)]] for rank in range(count)]
    base, extra = divmod(len(cpus), count)
    groups, start = [], 0
    for rank in range(count):
        size = base + (1 if rank < extra else 0)
        groups.append(cpus[start : start + size])
        start += size
    return groups


def thread_binding(world_size: int, cpus: list[int] | None = None) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` value giving each of `world_size` workers its own cores
    (`core_groups`)."""
    return "|".join(",".join(map(str, group)) for group in core_groups(world_size, cpus))


def configure_cpu_environment(world_size: int) -> None:
    """Set the CPU engine's environment for a `world_size`-worker engine, respecting the user's."""
    ours = []
    if _USER_ENV.get("VLLM_CPU_KVCACHE_SPACE") is None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = KV_CACHE_GIB
        ours.append("VLLM_CPU_KVCACHE_SPACE")
    if _USER_ENV.get("VLLM_CPU_OMP_THREADS_BIND") is None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = thread_binding(world_size)
        ours.append("VLLM_CPU_OMP_THREADS_BIND")
    os.environ[_OURS] = ",".join(ours)
