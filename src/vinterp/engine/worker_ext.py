"""vinterp inside vLLM's workers: sites installed at model load, runner hooks, trace RPCs.

`install_on_runner` runs right after a model runner loads its model and before vLLM
compiles it (the plugin patches `load_model`), so the sites and their steering buffers are
part of the compiled graph. `VinterpWorkerExtension` is mixed into vLLM's worker
(`worker_extension_cls`) and receives the trace lifecycle calls from `collective_rpc`.
"""

from __future__ import annotations

from typing import Any

from vinterp.engine.config_keys import (
    CAPTURE_IN_GRAPH_KEY,
    CAPTURE_ROWS_KEY,
    CHECK_APPLIED_KEY,
    SAE_CLAMP_HOSTS_KEY,
    SAE_CLAMP_KEY,
    SITE_PATHS_KEY,
)
from vinterp.engine.site_ops import SiteCalls
from vinterp.engine.vllm_boundary.parallel import last_stage_start, worker_layout
from vinterp.engine.vllm_boundary.runner_hooks import instrument, runner_kind
from vinterp.engine.vllm_boundary.site_modules import held_site_ids, install_vllm_sites
from vinterp.engine.vllm_boundary.targets import check_boundary
from vinterp.interventions.applied import AppliedCheck, AppliedCounters
from vinterp.interventions.capture_buffers import buffer_rows, buffer_site_ids
from vinterp.interventions.clamp_buffers import CLAMP_FEATURES, clamp_host_ids
from vinterp.interventions.steer_buffers import SteerBuffers
from vinterp.runtime.worker_runtime import WorkerRuntime
from vinterp.sites.modules import find_site_modules, site_order
from vinterp.sites.names import HEAD_SITES, SiteOrder

RUNTIME_ATTR = "_vinterp_runtime"
SITE_CALLS_ATTR = "_vinterp_site_calls"


def site_calls(runner: Any) -> SiteCalls:
    """The handlers the sites of `runner`'s model call in uncompiled steps."""
    return getattr(runner, SITE_CALLS_ATTR)


def steer_buffers_for(
    runner: Any, order: SiteOrder, counters: AppliedCounters | None = None
) -> SteerBuffers:
    """Buffers sized for the largest step the runner can run (graph padding included)."""
    config = runner.vllm_config
    settings = config.additional_config or {}
    max_seqs = config.scheduler_config.max_num_seqs
    max_tokens = max(
        config.scheduler_config.max_num_batched_tokens,
        config.compilation_config.max_cudagraph_capture_size or 0,
    )
    return SteerBuffers(
        num_sites=len(order.sites),
        hidden_size=int(runner.model_config.hf_config.hidden_size),
        max_tokens=max_tokens,
        max_combos=2 * max_seqs + 2,
        max_rows=2 * max_seqs + 2,
        dtype=runner.model_config.dtype,
        device=runner.device,
        counters=counters,
        clamp_hosts=clamp_host_ids(settings.get(SAE_CLAMP_HOSTS_KEY, []), order),
        clamp_features=settings.get(SAE_CLAMP_KEY, CLAMP_FEATURES),
    )


def install_on_runner(runner: Any) -> None:
    check_boundary()  # the plugin patched nothing where it fails; checked again for the error
    runner_kind(runner)  # refuses a runner vinterp cannot follow, before anything else
    config = runner.model_config.hf_config
    model = runner.get_model()
    settings = runner.vllm_config.additional_config or {}
    modules = find_site_modules(
        model, config.model_type, settings.get(SITE_PATHS_KEY), backend="vllm"
    )
    order = site_order(config)
    counters = None
    if settings.get(CHECK_APPLIED_KEY, False):
        counters = AppliedCounters(len(order.sites), runner.device)
    steer = steer_buffers_for(runner, order, counters)
    scheduler = runner.vllm_config.scheduler_config
    capture_rows = buffer_rows(
        settings.get(CAPTURE_ROWS_KEY), scheduler.max_num_seqs, scheduler.max_num_batched_tokens
    )
    capture_sites = buffer_site_ids(settings.get(CAPTURE_IN_GRAPH_KEY, False), order)
    parallel = worker_layout()
    if parallel.tp_size > 1:  # per-head sites: gathered, uncompiled
        capture_sites -= order.ids_of(HEAD_SITES)
    calls = SiteCalls()
    capture = install_vllm_sites(modules, order, steer, calls, capture_rows, capture_sites)

    runtime = WorkerRuntime(
        model,
        modules,
        order,
        steer,
        parallel,
        last_stage_start(order.num_layers, parallel.pipeline_size),
        capture,
        check=None
        if counters is None
        else AppliedCheck(counters, held_site_ids(modules, order), order),
    )
    instrument(runner, runtime, calls)
    setattr(runner, RUNTIME_ATTR, runtime)
    setattr(runner, SITE_CALLS_ATTR, calls)


class VinterpWorkerExtension:
    """Methods vLLM adds to its worker class; called with `llm.collective_rpc(name, ...)`."""

    @property
    def _vinterp(self) -> WorkerRuntime:
        return getattr(self.model_runner, RUNTIME_ATTR)  # type: ignore[attr-defined]

    def vinterp_begin(self, trace_id: str, wire: dict[str, Any]) -> str | None:
        return self._vinterp.begin(trace_id, wire)

    def vinterp_collect(self, trace_id: str) -> dict[str, Any]:
        return self._vinterp.collect(trace_id)

    def vinterp_attach_sae(self, site: str, wire: dict[str, Any]) -> str | None:
        return self._vinterp.attach_sae(site, wire)

    def vinterp_forget(self, trace_id: str) -> None:
        self._vinterp.forget(trace_id)

    def vinterp_set_steering(self, wires: list[dict[str, Any]]) -> None:
        self._vinterp.interventions.set_global(wires)

    def vinterp_register_steering(self, name: str, wire: dict[str, Any] | None) -> None:
        self._vinterp.interventions.register(name, wire)

    def vinterp_take_captures(
        self, capture_ids: list[str], handoff: dict[str, str] | None = None
    ) -> dict[str, Any]:
        return self._vinterp.interventions.take_captures(capture_ids, handoff)

    def vinterp_unapplied(self) -> list[str]:
        """What the applied check found not applied since the last call (check on)."""
        check = self._vinterp.check
        return [] if check is None else check.take()

    def vinterp_step_stats(self) -> dict[str, int]:
        return dict(self._vinterp.stats)

    def vinterp_held_state(self) -> dict[str, int]:
        """How much per-trace state this worker holds (zero when nothing is running)."""
        return self._vinterp.held_state()
