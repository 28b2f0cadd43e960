"""vinterp: read, change and save the internals of language models while vLLM serves them."""

from vinterp import models
from vinterp.api import LLM
from vinterp.api.errors import InterventionError, OutOfOrderError, TraceError, VinterpError
from vinterp.engine.outputs import Output

__all__ = [
    "LLM",
    "InterventionError",
    "OutOfOrderError",
    "Output",
    "TraceError",
    "VinterpError",
    "models",
]
