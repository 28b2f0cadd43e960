"""vinterp itself, the reference the peers are checked against: `vinterp.Capture` of every
layer at the last prompt token, and `vinterp.Steering` of one layer, on the vLLM engine."""

from __future__ import annotations

from typing import Any

import torch

from .protocol import Task


def version() -> str:
    from importlib.metadata import version as installed

    return installed("vinterp")


def load(task: Task) -> Any:
    import vinterp

    return vinterp.LLM(task.model, dtype="float32")


def close(llm: Any) -> None:
    llm.shutdown()


def extract(llm: Any, task: Task) -> torch.Tensor:
    import vinterp

    capture = vinterp.Capture("layers.*.output", positions="last_prompt")
    outs = llm.generate(task.prompts, max_tokens=1, capture=capture, use_tqdm=False)
    sites = [f"layers.{i}.output" for i in range(len(llm.layers))]
    return torch.stack([torch.stack([o.captures[s][-1] for s in sites]) for o in outs])


def steer(llm: Any, task: Task, vector: torch.Tensor) -> torch.Tensor:
    import vinterp

    steering = vinterp.Steering({f"layers.{task.layer}.output": vector}, scale=1.0)
    outs = llm.generate(
        task.prompts,
        max_tokens=task.max_tokens,
        ignore_eos=True,
        steering=steering,
        use_tqdm=False,
    )
    return torch.tensor([o.token_ids for o in outs])
