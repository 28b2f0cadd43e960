"""vinterp: read, change and save the internals of language models while vLLM serves them."""

from vinterp import models
from vinterp.api import LLM
from vinterp.api.async_llm import AsyncLLM
from vinterp.api.client import AsyncClient, Client
from vinterp.api.requests import Request
from vinterp.engine.outputs import Output
from vinterp.errors import (
    CaptureWriteError,
    InterventionError,
    OutOfOrderError,
    TraceError,
    VinterpError,
)
from vinterp.extraction.launch import extract
from vinterp.extraction.packing import Packed
from vinterp.sae import SAE
from vinterp.wire.json_form import captures_from_json
from vinterp.wire.probes import Probe
from vinterp.wire.specs import Capture, Steering, When

__all__ = [
    "AsyncClient",
    "AsyncLLM",
    "Capture",
    "CaptureWriteError",
    "Client",
    "LLM",
    "Request",
    "SAE",
    "Steering",
    "Packed",
    "Probe",
    "When",
    "InterventionError",
    "OutOfOrderError",
    "Output",
    "TraceError",
    "VinterpError",
    "captures_from_json",
    "extract",
    "models",
]
