"""The environment vinterp sets for the platform vLLM runs on, before each engine starts
(plain vLLM engines of the bench alike), where the user has not set it.

CPU: the KV cache size and the workers' cores (`cpu_settings`, DESIGN.md lesson 8).

GPU: the engine's processes are spawned, not forked (vLLM forks when the parent has not
initialised CUDA). On the lent H100s (microVMs with the GPU passed through), forked starts of
vLLM 0.32's V2 runner stalled for minutes at its first pinned host allocation (`UvaBuffer`;
docs/notes/gpu-log.md "Where the start stalls"), plain vLLM alike; of the starts with spawned
processes, none did. A spawned process re-imports the user's main module, which is why scripts
keep their work under `if __name__ == "__main__":` (README), as vLLM asks anyway.
"""

from __future__ import annotations

import os

from vinterp.engine.cpu_settings import configure_cpu_environment

MULTIPROC_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


def configure_engine_environment(world_size: int) -> None:
    """Settings for an engine of `world_size` workers (TP x PP) on this platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        configure_cpu_environment(world_size)
    else:
        os.environ.setdefault(MULTIPROC_METHOD, "spawn")


def gpu_platform() -> bool:
    """Whether vLLM runs on an accelerator here (not its CPU backend)."""
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()
