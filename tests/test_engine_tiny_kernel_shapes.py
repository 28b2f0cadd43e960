"""The model functions a trace offers (`llm.unembed`, `llm.final_norm`, `llm.lm_head`) hand the
engine's kernels what the GPU kernels take: vLLM's CUDA RMSNorm refuses a 1-D row or a
strided view (`aoti_torch_get_stride ... failed`), where the CPU's torch implementation takes
anything. Here the engine's RMSNorm runs through a stand-in that refuses the same, so rows
of any rank that pass here pass there."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.engine("tiny_kernel_shapes"), pytest.mark.usefixtures("in_process")]

PROMPT = "The capital of France is"


@pytest.fixture()
def strict_rms_norm(monkeypatch) -> list[tuple[int, ...]]:
    """vLLM's RMSNorm (its IR op's torch implementation, which the CPU engine runs) refusing
    all but a contiguous (rows, H) tensor, as the CUDA kernel does; the shapes it took."""
    from vllm import ir

    native = ir.ops.rms_norm.impls["native"]
    inner, taken = native.impl_fn, []

    def strict(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if x.dim() != 2 or not x.is_contiguous():
            raise RuntimeError(f"stand-in kernel: got shape {tuple(x.shape)}, {x.stride()}")
        taken.append(tuple(x.shape))
        return inner(x, *args, **kwargs)

    monkeypatch.setattr(native, "impl_fn", strict)
    return taken


def test_unembed_takes_rows_of_any_rank_and_views(engines, tiny_llama, strict_rms_norm) -> None:
    llm = engines.vllm(tiny_llama, enforce_eager=True)
    last = len(llm.layers) - 1
    with llm.trace(PROMPT, max_tokens=1):
        h = llm.layers[last].output
        row = llm.unembed(h[-1]).save()  # 1-D
        rows = llm.unembed(h[-2:]).save()  # 2-D
        every_other = llm.final_norm(h[::2]).save()  # rows of a strided view
        normed = llm.final_norm(h).save()
        batch = llm.unembed(torch.stack([h, h])).save()  # 3-D
        logits = llm.logits.save()
    assert strict_rms_norm, "the stand-in kernel never ran"
    assert row.shape == logits[0].shape and torch.allclose(row, logits[0], atol=1e-4)
    assert torch.allclose(rows[-1], row, atol=1e-5)
    assert torch.allclose(every_other, normed[::2], atol=1e-6)
    assert batch.shape == (2, len(normed), len(row)) and torch.allclose(
        batch[1, -1], row, atol=1e-5
    )
