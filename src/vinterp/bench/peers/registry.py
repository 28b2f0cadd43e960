"""The tools compared: which module runs each, from which environment."""

from __future__ import annotations

from dataclasses import dataclass

from .envs import Env


@dataclass(frozen=True)
class Peer:
    name: str  # the row's label
    module: str  # the tool's module in this package (see worker.py)
    env: Env | None = None  # None: vinterp's own interpreter


# Layered environments see vinterp's packages (vLLM among them): these peers must install
# next to this vLLM, changing none of vinterp's pins. TransformerLens 3.x, on HF only, gets a
# plain environment of its own (its resolver picks its own transformers release).
NNSIGHT = Env("nnsight-0.8.1", ("nnsight==0.8.1",), layered=True)
# TransformerLens 3.9.0 leaves transformers open; under 5.24 its `generate` with a hook gave
# other tokens for every prompt (2026-11-26), under 5.19.0, vinterp's own, it agrees.
TLENS_3 = Env(
    "tlens-3.9.0-transformers-5.19.0", ("transformer-lens==3.9.0", "transformers==5.19.0")
)
VINTERP = Peer("vinterp (vLLM engine)", "vinterp_side")
PEERS = (
    Peer("HF transformers + hooks", "hf_hooks"),
    Peer("nnsight 0.8.1 LanguageModel (HF)", "nnsight_hf", NNSIGHT),
    Peer("TransformerLens 3.9.0", "tlens", TLENS_3),
    Peer("nnsight 0.8.1 vLLM backend", "nnsight_vllm", NNSIGHT),
    Peer(
        "TransformerLens 4.3.0 vLLM bridge",
        "tlens_vllm",
        Env("tlens-4.3.0", ("transformer-lens==4.3.0",), layered=True),
    ),
    # No `vllm_lens` module yet: 1.3.0 needs Python >= 3.12 and vllm==0.30.0, so its
    # environment does not build next to this vLLM and the row shows pip's error. Write the
    # module (SamplingParams extra_args={"output_residual_stream": [...]}) once it installs.
    Peer(
        "vllm-lens 1.3.0",
        "vllm_lens",
        Env("vllm-lens-1.3.0", ("vllm-lens==1.3.0",), layered=True),
    ),
)
