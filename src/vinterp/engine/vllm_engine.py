"""The vLLM backend: starts a vLLM engine with this machine's settings and generates with it."""

from __future__ import annotations

import atexit
import logging
from pathlib import Path
from typing import Any

from vinterp.engine.cpu_settings import configure_cpu_environment
from vinterp.engine.outputs import Output

log = logging.getLogger(__name__)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class VLLMEngine:
    """Owns one `vllm.LLM`; `shutdown()` stops its engine core and worker processes."""

    def __init__(
        self,
        model: Path,
        dtype: str,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        **engine_kwargs: Any,
    ) -> None:
        import vllm

        if _on_cpu():
            configure_cpu_environment(tensor_parallel_size * pipeline_parallel_size)
        kwargs: dict[str, Any] = {
            "dtype": dtype,
            "enable_prefix_caching": False,  # DESIGN.md lesson 1: hooks would miss cached tokens
            "seed": 0,
        }
        kwargs.update(engine_kwargs)
        self.llm = vllm.LLM(
            model=str(model),
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            **kwargs,
        )
        self._closed = False
        atexit.register(self.shutdown)

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[Output]:
        """Generate for token-id prompts, in order."""
        import vllm

        params = vllm.SamplingParams(**sampling)
        results = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False
        )
        return [
            Output(
                prompt_token_ids=list(r.prompt_token_ids or []),
                token_ids=list(r.outputs[0].token_ids),
                text=r.outputs[0].text,
            )
            for r in results
        ]

    def shutdown(self) -> None:
        """Stop the engine core and its workers; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:  # already torn down by vLLM's own finalizers
            log.debug("vLLM engine shutdown raised", exc_info=True)
