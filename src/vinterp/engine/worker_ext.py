"""vinterp inside vLLM's workers: sites installed at model load, runner hooks, trace RPCs.

`install_on_runner` runs right after a model runner loads its model and before vLLM
compiles it (the plugin patches `load_model`), so the sites and their steering buffers are
part of the compiled graph. `VinterpWorkerExtension` is mixed into vLLM's worker
(`worker_extension_cls`) and receives the trace lifecycle calls from `collective_rpc`.
"""

from __future__ import annotations

from typing import Any

from vinterp.engine.settings import EngineSettings
from vinterp.engine.site_ops import SiteCalls
from vinterp.engine.vllm_boundary.engine_config import (
    RunnerConfig,
    runner_config,
    worker_runner,
)
from vinterp.engine.vllm_boundary.parallel import last_stage_start, stage_starts, worker_layout
from vinterp.engine.vllm_boundary.runner_hooks import instrument, runner_kind
from vinterp.engine.vllm_boundary.site_modules import held_site_ids, install_vllm_sites
from vinterp.engine.vllm_boundary.targets import check_boundary
from vinterp.interventions.applied import AppliedCheck, AppliedCounters
from vinterp.interventions.capture_buffers import buffer_rows, buffer_site_ids
from vinterp.interventions.feature_buffers import sae_steering_host_ids
from vinterp.interventions.probe_buffers import probe_site_ids
from vinterp.interventions.steer_buffers import SteerBuffers
from vinterp.runtime.worker_parts import build_parts
from vinterp.runtime.worker_runtime import WorkerRuntime
from vinterp.sites.modules import find_site_modules, site_order
from vinterp.sites.names import HEAD_SITES, SiteOrder

RUNTIME_ATTR = "_vinterp_runtime"
SITE_CALLS_ATTR = "_vinterp_site_calls"


def site_calls(runner: Any) -> SiteCalls:
    """The handlers the sites of `runner`'s model call in uncompiled steps."""
    return getattr(runner, SITE_CALLS_ATTR)


def steer_buffers_for(
    runner: RunnerConfig,
    order: SiteOrder,
    settings: EngineSettings,
    counters: AppliedCounters | None = None,
) -> SteerBuffers:
    """Buffers sized for the largest step the runner can run (graph padding included)."""
    return SteerBuffers(
        num_sites=len(order.sites),
        hidden_size=int(runner.hf_config.hidden_size),
        max_tokens=runner.padded_step_tokens,
        max_combos=2 * runner.step_sequences + 2,
        max_rows=2 * runner.step_sequences + 2,
        dtype=runner.dtype,
        device=runner.device,
        counters=counters,
        feature_hosts=sae_steering_host_ids(list(settings.sae_steering_hosts), order),
        features_per_host=settings.sae_steering_features,
        probe_sites=probe_site_ids(list(settings.probe_sites), order),
        in_graph=settings.steering_in_graph,
    )


def install_on_runner(runner: Any, settings: EngineSettings) -> None:
    check_boundary()  # the plugin patched nothing where it fails; checked again for the error
    runner_kind(runner)  # refuses a runner vinterp cannot follow, before anything else
    facts = runner_config(runner)
    model, config = facts.model, facts.hf_config
    modules = find_site_modules(model, config.model_type, dict(settings.site_paths), backend="vllm")
    order = site_order(config)
    counters = None
    if settings.check_applied:
        counters = AppliedCounters(len(order.sites), facts.device)
    steer = steer_buffers_for(facts, order, settings, counters)
    capture_rows = buffer_rows(settings.capture_rows, facts.step_sequences, facts.step_tokens)
    capture_sites = buffer_site_ids(settings.capture_setting, order)
    parallel = worker_layout()
    if parallel.tp_size > 1:  # per-head sites: gathered, uncompiled
        capture_sites -= order.ids_of(HEAD_SITES)
    calls = SiteCalls()
    capture = install_vllm_sites(modules, order, steer, calls, capture_rows, capture_sites)

    held = held_site_ids(modules, order)
    parts = build_parts(
        model,
        modules,
        order,
        steer,
        parallel,
        last_stage_start(order.num_layers, parallel.pipeline_size),
        capture,
        check=None if counters is None else AppliedCheck(counters, held, order),
        held=held,
        stage_starts=stage_starts(order.num_layers, parallel.pipeline_size),
    )
    runtime = WorkerRuntime.of(parts)
    instrument(runner, runtime, calls)
    setattr(runner, RUNTIME_ATTR, runtime)
    setattr(runner, SITE_CALLS_ATTR, calls)


class VinterpWorkerExtension:
    """Methods vLLM adds to its worker class; called with `llm.collective_rpc(name, ...)`."""

    @property
    def _vinterp(self) -> WorkerRuntime:
        return getattr(worker_runner(self), RUNTIME_ATTR)

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
