"""How fast can the bench's peer workloads run on this machine at all? (docs/BENCH.md)

    python scripts/cpu_roofline.py [--model PATH]

Counts the matmul FLOPs of the two peer workloads of `vinterp bench` (batch extraction: every
layer at the last prompt token of 256 prompts; steered generation: 64 prompts x 32 tokens),
measures this machine's float32 matmul rate on the model's own GEMM shapes with torch's
threads, and prints the time each workload needs at that rate. The measured rate moves with
the machine's load; the bound that holds is the cores' peak (docs/BENCH.md). Attention
scores over ~15-token prompts are a rounding error here
and are left out.
"""

from __future__ import annotations

import argparse
import time

import torch


def linear_params(config) -> tuple[int, int]:
    """(weights of the decoder layers' linear layers, weights of the LM head)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter
    return config.num_hidden_layers * per_layer, hidden * config.vocab_size


def matmul_rate(config, tokens: int, repeats: int = 20) -> float:
    """GFLOP/s of float32 matmuls of `tokens` rows through the layer shapes (best of runs)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    x, h = torch.randn(tokens, hidden), torch.randn(tokens, inter)
    weights = [
        torch.randn(hidden, hidden),
        torch.randn(hidden, 2 * inter),
        torch.randn(inter, hidden),
    ]
    flops = 2 * tokens * (hidden * hidden + hidden * 2 * inter + inter * hidden)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x @ weights[0]
        x @ weights[1]
        h @ weights[2]
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF checkpoint (default: bundled)")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoTokenizer

    import vinterp
    from vinterp.bench.fastpath import PROMPT_TEMPLATE
    from vinterp.bench.peers.suite import BATCH, Sizes

    model = args.model or vinterp.models.bundled()
    config = AutoConfig.from_pretrained(str(model))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    sizes = Sizes()
    lengths = [len(tokenizer(PROMPT_TEMPLATE.format(i=i)).input_ids) for i in range(256)]
    layers, head = linear_params(config)
    extract_tokens = sum(lengths[: sizes.extract_prompts])
    padded = sum(
        BATCH * max(lengths[i : i + BATCH]) for i in range(0, sizes.extract_prompts, BATCH)
    )
    steer_prompt = sum(lengths[: sizes.steer_prompts])
    steer_new = sizes.steer_prompts * sizes.steer_tokens
    workloads = {  # (name, matmul FLOPs without padding)
        "batch extraction (no LM head)": 2 * layers * extract_tokens,
        "steered generation (+ LM head per new token)": 2 * layers * (steer_prompt + steer_new)
        + 2 * head * steer_new,
    }
    print(f"threads: {torch.get_num_threads()}; prompt tokens {min(lengths)}-{max(lengths)}")
    print(f"extraction: {extract_tokens} tokens ({padded} with HF's right padding in batches)")
    for rows in (64, 1024, 4096):
        print(f"float32 matmul rate, {rows} rows: {matmul_rate(config, rows):.0f} GFLOP/s")
    rate = max(matmul_rate(config, rows) for rows in (64, 1024, 4096))
    for name, flops in workloads.items():
        print(f"{name}: {flops / 1e12:.3f} TFLOP -> {flops / rate / 1e9:.2f} s at that rate")


if __name__ == "__main__":
    main()
