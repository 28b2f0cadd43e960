"""Lets vLLM 0.32's CPU engine load the compiled model it saved, instead of compiling again.

On the CPU backend vLLM compiles in DYNAMO_TRACE_ONCE mode with torch's own Inductor backend,
so the AOT artifact it saves holds a plain compiled function. On the next start its loader
calls `finalize_loading`, which only vLLM's own backend artifact has; the load fails
("'function' object has no attribute 'finalize_loading'") and every engine start compiles the
model from nothing (3.5 of a bundled-model start's 5 minutes on two cores). A plain function
is already loaded, so finalizing it is nothing to do.
"""

from __future__ import annotations

import functools
from typing import Any


def _finalized(vllm_config: Any) -> None:
    """`finalize_loading` for a compiled function that deserialization already loaded."""


def patch_aot_loading() -> None:
    """Wrap `torch.compiler.load_compiled_function` once per process (harmless elsewhere: it
    adds the no-op only where the loaded artifact lacks the method)."""
    import torch.compiler

    original = torch.compiler.load_compiled_function
    if getattr(original, "_vinterp", False):
        return

    @functools.wraps(original)
    def load_compiled_function(*args: Any, **kwargs: Any) -> Any:
        loaded = original(*args, **kwargs)
        compiled = getattr(getattr(loaded, "_artifacts", None), "compiled_fn", None)
        if compiled is not None and not hasattr(compiled, "finalize_loading"):
            compiled.finalize_loading = _finalized
        return loaded

    load_compiled_function._vinterp = True  # type: ignore[attr-defined]
    torch.compiler.load_compiled_function = load_compiled_function
