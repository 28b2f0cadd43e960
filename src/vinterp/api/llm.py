"""`vinterp.LLM`: one object for a model served by vLLM or run by transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from vinterp.api.front_end import TraceFrontEnd
from vinterp.api.requests import Request, generate
from vinterp.api.sae_sites import check_attachable
from vinterp.api.steering_control import SteeringControl
from vinterp.api.trace import Prompt
from vinterp.engine.backend import Backend
from vinterp.engine.outputs import Output
from vinterp.engine.settings import GRAPH_KEYWORDS, EngineSettings
from vinterp.extraction.local import extract_on
from vinterp.extraction.request import BUFFER_GB, ExtractionRequest
from vinterp.extraction.stream import Extraction
from vinterp.models.dtype import checkpoint_dtype
from vinterp.sae import SAE
from vinterp.sites.modules import check_site_paths
from vinterp.wire.probes import Probe
from vinterp.wire.specs import Capture, Steering

BACKENDS = ("vllm", "hf")


def checked_num_layers(num_layers: Any, config: Any) -> int:
    """`num_layers` checked against the model: 1 up to its depth; ValueError otherwise."""
    depth = int(config.num_hidden_layers)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise ValueError(f"num_layers: expected an int, got {num_layers!r}")
    if not 1 <= num_layers <= depth:
        raise ValueError(
            f"num_layers={num_layers}: this model has {depth} layers; give 1..{depth} "
            "(the engine runs layers 0..num_layers-1)"
        )
    return num_layers


class LocalModel(TraceFrontEnd):
    """What `LLM` and `AsyncLLM` share: a checkpoint on this machine, its configuration and
    tokenizer (loaded before any engine starts, so bad arguments fail fast), the engine's
    lifetime."""

    def _load(
        self,
        model: str | Path | None,
        backend: str,
        pipeline_parallel_size: int,
        sites: dict[str, str] | None,
        engine_kwargs: dict[str, Any],
    ) -> tuple[str | Path, str]:
        """Reads the model's description; returns the checkpoint and the dtype to run in."""
        from transformers import AutoConfig, AutoTokenizer

        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if model is None:
            from vinterp.models import bundled

            model = bundled()
        self.model_path = model
        self.model_name = str(model)
        self.pipeline_parallel_size = pipeline_parallel_size
        self.config = AutoConfig.from_pretrained(str(model))
        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        check_site_paths(self.config.model_type, sites)
        num_layers = engine_kwargs.get("num_layers")
        if num_layers is not None:
            self.config.num_hidden_layers = checked_num_layers(num_layers, self.config)
            if backend == "hf":  # transformers builds the layers its config names
                engine_kwargs["num_hidden_layers"] = engine_kwargs.pop("num_layers")
        if backend == "vllm":
            from vinterp.engine.vllm_engine import check_engine_features, check_native_model

            check_native_model(self.config, engine_kwargs)
            check_engine_features(engine_kwargs)
            self.settings = EngineSettings.from_keywords(engine_kwargs, sites, self.config)
        else:  # no graphs to follow
            for graph_setting in GRAPH_KEYWORDS:
                engine_kwargs.pop(graph_setting, None)
        return model, engine_kwargs.pop("dtype", None) or checkpoint_dtype(self.config)

    @property
    def engine(self) -> Any:
        """The underlying `vllm.LLM` (vLLM's `AsyncLLM` for vinterp.AsyncLLM; the transformers
        model with backend="hf")."""
        return self.backend.native

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts).input_ids

    def shutdown(self) -> None:
        """Stop the engine and its worker processes (also done at interpreter exit)."""
        self.backend.shutdown()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class LLM(LocalModel):
    """A model to trace, steer and capture, served by vLLM or run by transformers.

    `model` is a local HF checkpoint directory (or a hub id where a hub is reachable); None is
    the bundled SmolLM2-135M-Instruct. The dtype defaults to the checkpoint's own on both
    backends, so the engine and the reference compute in the same precision. `sites` maps
    site keys (embed, layers, final_norm, lm_head, attn, mlp) to module paths for models
    whose modules are named differently from the supported families.

    vLLM backend: `capture_in_graph=True` captures inside the compiled model, so capturing
    steps keep vLLM's CUDA graphs (steps with more captured rows than the buffers hold,
    `max_num_seqs` of them, still leave them); it adds a gather per site to every step,
    captured or not. Naming the sites (`capture_in_graph="layers.*.output"`, or a list)
    limits that price to them; captures of other sites leave the graphs for their steps.
    `capture_in_graph_rows="step"` sizes the buffers for every token of a step (captures of
    all prompt positions, as `extract` makes, stay compiled), or give a number of rows.
    `check_applied=True` (or the environment variable VINTERP_CHECK_APPLIED=1) counts on the
    device what the site ops applied and raises `InterventionError` when a step applied less
    than it asked for; it waits for every step, so it is for tests and debugging.
    `sae_steering_hosts` (a site, a glob or a list; default none) names the SAE hosts whose
    feature steering stays in the compiled graph, with tables of `sae_steering_features`
    (default 32) features per host (API.md section 5, "Sparse autoencoders").
    `probe_sites` (a site, a glob or a list; default none) names the sites where probes are
    scored and `Steering(when=...)` is gated in the compiled graph (API.md section 5,
    "Probes"). `steering_in_graph=False` leaves the steering formula out of the compiled
    model: an engine that only captures and extracts saves its price at every site (large in
    prefill steps); a steered request still gets its steering, in uncompiled steps. The
    engines `extract` starts are made so.

    Both backends: `num_layers=N` builds and loads only layers 0..N-1 (what an extraction
    that stops at layer N-1 needs; `llm.config.num_hidden_layers` is then N, and the logits
    are those of the final norm applied to layer N-1's output). Other keyword arguments are
    vLLM's engine arguments.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        backend: Literal["vllm", "hf"] = "vllm",
        sites: dict[str, str] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        model, dtype = self._load(model, backend, pipeline_parallel_size, sites, engine_kwargs)
        if backend == "hf":
            if tensor_parallel_size != 1 or pipeline_parallel_size != 1:
                raise ValueError("backend='hf' runs in one process: use tensor/pipeline size 1")
            from vinterp.engine.hf_engine import HFEngine

            self.backend: Backend = HFEngine(
                Path(model), dtype, self.tokenizer, sites, **engine_kwargs
            )
        else:
            from vinterp.engine.vllm_engine import VLLMEngine

            sizes = (tensor_parallel_size, pipeline_parallel_size)
            self.backend = VLLMEngine(model, dtype, *sizes, self.settings, **engine_kwargs)
        self._init_front_end()
        self.steering = SteeringControl(self)

    def generate(
        self,
        prompts: Prompt | Request | list[Prompt | Request],
        steering: Steering | str | list[Steering | str] | None = None,
        capture: Capture | None = None,
        use_tqdm: bool = True,
        probes: list[Probe] | None = None,
        **sampling: Any,
    ) -> list[Output]:
        """Complete each prompt, optionally steered, captured and probed (API.md section 5;
        `out.probes[name]`: a probe's scores at every token read).

        Sampling options are vLLM's (greedy, 16 tokens by default). Specs are checked against
        the model before anything is queued. A progress bar shows unless `use_tqdm=False`."""
        return generate(self, prompts, steering, capture, sampling, use_tqdm, probes)

    def attach_sae(self, site: str, sae: SAE) -> None:
        """Attach a sparse autoencoder at `site` (e.g. "layers.10.output"; one per site, a
        later one replaces it): `<site>.sae.features` and `.sae.error` become sites of traces,
        captures and steering (API.md section 5, "Sparse autoencoders"). Checked here (the
        site, the SAE's width), then sent to every worker once."""
        check_attachable(self.config, site, sae)
        self.backend.attach_sae(site, sae)
        self.saes[site] = sae

    def extract(
        self,
        prompts: Any,
        sites: str | list[str],
        *,
        out: str | Path,
        positions: str | list[int] = "all_prompt",
        dtype: str | None = None,
        skip_first: int = 0,
        column: str = "text",
        buffer_gb: float = BUFFER_GB,
        topk: int | None = None,
        use_tqdm: bool = True,
    ) -> Extraction:
        """Write the activations at `sites` of every prompt's `positions` to a Hugging Face
        `datasets` directory `out`, streaming with bounded memory; a run stopped at any moment
        continues when called again with the same arguments (API.md section 5, "Activation
        datasets"). Returns the dataset (`.dataset`, `datasets.load_from_disk(out)`) and the
        call's statistics (`.stats`: rows, bytes, seconds, the waits). An attached SAE's
        `<site>.sae.features` are stored as their `topk` largest per token: columns
        `<site>.sae.features.indices` and `.values` (API.md section 5, "Sparse
        autoencoders")."""
        request = ExtractionRequest(
            prompts=prompts,
            sites=sites,
            out=out,
            positions=positions,
            dtype=dtype,
            skip_first=skip_first,
            column=column,
            buffer_gb=buffer_gb,
            topk=topk,
        )
        return extract_on(self, request, use_tqdm)

    def step_stats(self) -> dict[str, int]:
        """vLLM backend: forward steps run so far and how many ran uncompiled, outside CUDA
        graphs (steps that trace or capture); steering alone never leaves the graphs.
        "watched": requests looked at for captures and traces, summed over steps (a capture
        is no longer looked at once its last position is computed)."""
        return self.backend.step_stats()
