"""vLLM's private model-registry and process utilities that vinterp reads or calls."""

from __future__ import annotations


def transformers_backend_architectures() -> frozenset[str]:
    """Architectures vLLM runs only through its Transformers backend."""
    from vllm.model_executor.models.registry import _TRANSFORMERS_SUPPORTED_MODELS

    return frozenset(_TRANSFORMERS_SUPPORTED_MODELS)


def freeze_gc_heap() -> None:
    """vLLM's own freeze of the objects alive now out of the cyclic collector's scans."""
    from vllm.utils.gc_utils import freeze_gc_heap as freeze

    freeze()
