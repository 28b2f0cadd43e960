"""vinterp inside vLLM's workers: site ops installed at model load, trace RPCs.

`install_on_runner` runs right after a model runner loads its model and before vLLM
compiles it (the plugin patches `load_model`), so the site ops are part of the compiled
graph. `VinterpWorkerExtension` is mixed into vLLM's worker (`worker_extension_cls`) and
receives the trace lifecycle calls from `collective_rpc`.
"""

from __future__ import annotations

from typing import Any

import torch

from vinterp.runtime.vllm_runtime import WorkerRuntime
from vinterp.sites.modules import find_site_modules
from vinterp.sites.names import SiteOrder
from vinterp.sites.vllm_sites import install_vllm_sites

RUNTIME_ATTR = "_vinterp_runtime"


def install_on_runner(runner: Any) -> None:
    config = runner.model_config.hf_config
    model = runner.model
    overrides = (runner.vllm_config.additional_config or {}).get("vinterp_site_paths")
    modules = find_site_modules(model, config.model_type, overrides, backend="vllm")
    order = SiteOrder(int(config.num_hidden_layers))
    install_vllm_sites(modules, order)
    from vllm.distributed import get_tensor_model_parallel_rank

    runtime = WorkerRuntime(
        runner,
        modules,
        order,
        int(config.vocab_size),
        captures_here=get_tensor_model_parallel_rank() == 0,  # TP ranks hold the same values
    )
    model.register_forward_pre_hook(lambda module, args: runtime.begin_step())
    compute_logits = model.compute_logits

    def logits_with_sites(hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = compute_logits(hidden_states)
        return None if logits is None else runtime.on_logits(logits)

    model.compute_logits = logits_with_sites
    runner.sampler.register_forward_hook(
        lambda module, args, out: runtime.on_samples(out.sampled_token_ids[:, 0])
    )
    setattr(runner, RUNTIME_ATTR, runtime)


class VinterpWorkerExtension:
    """Methods vLLM adds to its worker class; called with `llm.collective_rpc(name, ...)`."""

    @property
    def _vinterp(self) -> WorkerRuntime:
        return getattr(self.model_runner, RUNTIME_ATTR)  # type: ignore[attr-defined]

    def vinterp_begin(self, trace_id: str, wire: dict[str, Any]) -> str | None:
        return self._vinterp.begin(trace_id, wire)

    def vinterp_collect(self, trace_id: str) -> dict[str, Any]:
        return self._vinterp.collect(trace_id)

    def vinterp_forget(self, trace_id: str) -> None:
        self._vinterp.forget(trace_id)

    def vinterp_set_steering(self, wires: list[dict[str, Any]]) -> None:
        self._vinterp.fast.set_global(wires)

    def vinterp_register_steering(self, name: str, wire: dict[str, Any] | None) -> None:
        self._vinterp.fast.register(name, wire)

    def vinterp_take_captures(self, capture_ids: list[str]) -> dict[str, Any]:
        return self._vinterp.fast.take_captures(capture_ids)
