"""`vinterp.extract`: the engines started for an extraction, one in this process or
data-parallel replicas through Ray (extraction/replicas.py), with the SAEs checked before any
of them starts."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vinterp.extraction.local import extract_on
from vinterp.extraction.plan import PositionSpec
from vinterp.extraction.replicas import check_replicas, run_replicas
from vinterp.extraction.request import (
    BUFFER_GB,
    ExtractionRequest,
    engine_settings,
    expand_sites,
    layers_needed,
)
from vinterp.extraction.sae import check_sae_sites, load_saes
from vinterp.extraction.stream import Extraction
from vinterp.sae import SAE
from vinterp.sites.names import sae_site

log = logging.getLogger(__name__)


def extract(
    model: str | Path,
    prompts: Any,
    sites: str | list[str],
    *,
    out: str | Path,
    positions: PositionSpec = "all_prompt",
    dtype: str | None = None,
    skip_first: int = 0,
    column: str = "text",
    buffer_gb: float = BUFFER_GB,
    topk: int | None = None,
    use_tqdm: bool = True,
    data_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    ray_address: str | None = None,
    saes: Mapping[str, SAE | str | Path] | None = None,
    engine_dtype: str | None = None,
    stop_at_deepest: bool = True,
    **engine_kwargs: Any,
) -> Extraction:
    """The activations at `sites` of every prompt's `positions` of `model`, written to the
    dataset `out` as `llm.extract` writes them (API.md section 5), on `data_parallel_size`
    engine replicas of `tensor_parallel_size` GPUs each. One replica without `ray_address`
    runs in this process; otherwise the replicas are Ray actors, on the cluster at
    `ray_address` or on one started here. `saes` ({host site: SAE or its directory}) are
    checked here, before any engine starts, and attached in every replica (a directory is
    loaded there); `engine_dtype` is the engine's (default: the checkpoint's). Each engine
    runs only the layers up to the deepest site's (`num_layers`) unless `stop_at_deepest` is
    False. The keywords up to `use_tqdm` are `llm.extract`'s, with its defaults."""
    from transformers import AutoConfig

    check_replicas(data_parallel_size, tensor_parallel_size, 1, on_gpus=False)
    names = [sites] if isinstance(sites, str) else list(sites)
    config = AutoConfig.from_pretrained(str(model))
    loaded = check_saes(config, names, saes or {}, topk)
    request = ExtractionRequest(
        prompts=prompts,
        sites=names,
        out=out,
        positions=positions,
        dtype=dtype,
        skip_first=skip_first,
        column=column,
        buffer_gb=buffer_gb,
        topk=topk,
    )
    kwargs = {**engine_kwargs, "tensor_parallel_size": tensor_parallel_size}
    if engine_dtype is not None:
        kwargs["dtype"] = engine_dtype
    if stop_at_deepest and "num_layers" not in kwargs:
        needed = layers_needed(config, names)
        if needed is not None and needed < int(config.num_hidden_layers):
            kwargs["num_layers"] = needed
            log.info(
                "the extraction engine runs layers 0..%d of %d (the deepest site's); "
                "stop_at_deepest=False runs them all",
                needed - 1,
                int(config.num_hidden_layers),
            )
    if data_parallel_size == 1 and ray_address is None:
        from vinterp.api.llm import LLM

        with LLM(model, **engine_settings(names, positions), **kwargs) as llm:
            for site, sae in loaded.items():
                llm.attach_sae(site, sae)
            return extract_on(llm, request, use_tqdm)
    sent = {  # directories travel as absolute paths: a replica may run elsewhere
        site: sae if isinstance(sae, SAE) else str(Path(sae).resolve())
        for site, sae in (saes or {}).items()
    }
    import ray

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
    try:
        return run_replicas(
            ray,
            str(model),
            request,
            data_parallel_size,
            tensor_parallel_size,
            use_tqdm,
            kwargs,
            sent,
        )
    finally:
        if started_ray:
            ray.shutdown()


def check_saes(
    config: Any, sites: list[str], saes: Mapping[str, SAE | str | Path], topk: int | None
) -> dict[str, SAE]:
    """The SAEs loaded and checked, with the SAE sites and `topk`, against the model's
    config: ValueError before any engine starts."""
    if not saes and topk is None and not any(sae_site(site) for site in sites):
        return {}
    loaded = load_saes(config, saes)
    widths = {site: sae.d_sae for site, sae in loaded.items()}
    check_sae_sites(expand_sites(config, sites), widths, topk)
    return loaded
