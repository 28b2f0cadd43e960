"""Peers' outputs against vinterp's, so that a fast wrong answer cannot win: residuals
within fp32 tolerance (kernels differ in summation order), greedy tokens equal (up to a
few near-ties)."""

from __future__ import annotations

import torch

from .protocol import EXTRACT

# Residuals: |peer - vinterp| <= ATOL + RTOL * max|vinterp| per layer. Residual streams carry
# a few large entries, so the scale is each layer's largest magnitude.
RTOL = 1e-3
ATOL = 1e-4
# Tokens: at most one prompt in NEAR_TIE_SHARE may part from vinterp's, after its first token.
NEAR_TIE_SHARE = 16


def verdict(workload: str, reference: torch.Tensor, output: torch.Tensor | None) -> str:
    """'ok', or 'WRONG: ...' saying how the output differs from the reference."""
    if output is None:
        return "WRONG: no output"
    if output.shape != reference.shape:
        return f"WRONG: shape {tuple(output.shape)}, expected {tuple(reference.shape)}"
    if workload == EXTRACT:
        return _residuals(reference.float(), output.float())
    return _tokens(reference, output)


def _residuals(reference: torch.Tensor, output: torch.Tensor) -> str:
    scale = reference.abs().amax(dim=(0, 2))  # per layer
    error = (output - reference).abs().amax(dim=(0, 2))
    bad = (error > ATOL + RTOL * scale).nonzero().flatten().tolist()
    worst = float((error / scale.clamp_min(1e-12)).max())
    if bad:
        return f"WRONG: layers {bad} differ (max relative error {worst:.1e})"
    return f"ok (max relative error {worst:.1e})"


def _tokens(reference: torch.Tensor, output: torch.Tensor) -> str:
    same = (reference == output).all(dim=1)
    if bool(same.all()):
        return "ok (tokens equal)"
    differ = (~same).nonzero().flatten().tolist()
    # Greedy decoding turns a float32 summation-order difference (GPU kernels differ between
    # tools) into a different token at a near-tie, and all later tokens follow it. A few
    # prompts that agree on their first tokens are that; a steering that was not applied, or
    # applied wrongly, changes most prompts from the start.
    agreed = [int((reference[i] != output[i]).nonzero()[0]) for i in differ]
    if len(differ) * NEAR_TIE_SHARE <= len(same) and min(agreed) >= 1:
        return (
            f"ok ({len(same) - len(differ)}/{len(same)} prompts equal; prompts {differ} "
            f"agree on their first {min(agreed)}+ tokens, then part at a near-tie)"
        )
    return f"WRONG: {len(differ)}/{len(same)} prompts' tokens differ (first: prompt {differ[0]})"
