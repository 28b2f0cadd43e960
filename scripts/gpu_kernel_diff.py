"""Where a compiled engine's uncompiled step parts from an `enforce_eager=True` engine's: every
module of the first layers, read through raw sites in one traced prompt step on each engine,
compared in forward order. With the eager-kernel switch (engine/eager_kernels.py) the two run
the same kernels. The first row that is not 0 names where they part: on the CPU none; on an
H200 in fp32 none with one invoke, and with `--invokes 2` the first matmul, on equal inputs
(docs/GPU.md, fourteenth session).

    python3 scripts/gpu_kernel_diff.py [--model PATH] [--dtype float32] [--layers 2] [--invokes 1]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import vinterp

PROMPTS = ("The capital of France is", "Once upon a time there was a")
# vLLM's Llama modules of one layer, in forward order (its rotary module is shared by all layers)
LAYER_MODULES = (
    "input_layernorm",
    "self_attn.qkv_proj",
    "self_attn.attn",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_up_proj",
    "mlp.act_fn",
    "mlp.down_proj",
)


def module_paths(layers: int) -> list[str]:
    inner = [f"model.layers.{i}.{m}" for i in range(layers) for m in LAYER_MODULES]
    return ["model.embed_tokens", *inner]


def raw_module(llm: vinterp.LLM, path: str) -> Any:
    node = llm.raw
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def tensors(value: Any) -> list[torch.Tensor]:
    """A raw value's tensors (vLLM modules return tensors, tuples and (output, bias) lists)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    return []


def read(
    path: str, dtype: str, paths: list[str], invokes: int, **engine_kwargs: Any
) -> dict[str, Any]:
    """The first invoke's module outputs and logits, the other invokes batched in the same step."""
    llm = vinterp.LLM(path, dtype=dtype, **engine_kwargs)
    try:
        with llm.trace(max_tokens=1) as tr:
            with tr.invoke(PROMPTS[0]):
                saved = {p: raw_module(llm, p).output.save() for p in paths}
                saved["logits"] = llm.logits.save()
            for prompt in PROMPTS[1:invokes]:
                with tr.invoke(prompt):
                    llm.logits.save()
        return saved
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Llama checkpoint (default: tiny llama)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--invokes", type=int, default=1, choices=range(1, len(PROMPTS) + 1))
    args = parser.parse_args()
    model = args.model or str(vinterp.models.tiny("llama"))
    paths = module_paths(args.layers)
    compiled = read(model, args.dtype, paths, args.invokes)
    eager = read(model, args.dtype, paths, args.invokes, enforce_eager=True)
    print(f"{'module output: compiled engine uncompiled - eager':<60} {'max abs':>10} {'rel':>9}")
    for name in [*paths, "logits"]:
        for i, (a, b) in enumerate(zip(tensors(compiled[name]), tensors(eager[name]))):
            diff = float((a.float() - b.float()).abs().max())
            rel = diff / max(float(b.float().abs().max()), 1e-30)
            print(f"{name + (f'[{i}]' if i else ''):<60} {diff:10.3e} {rel:9.2e}", flush=True)


if __name__ == "__main__":
    main()
