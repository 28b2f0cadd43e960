"""The transformers backend: the same checkpoint run by HF modules, the reference for checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vinterp.engine.outputs import Output

SUPPORTED_SAMPLING = {"temperature", "max_tokens", "seed", "ignore_eos", "stop_token_ids"}


class HFEngine:
    """One prompt at a time with a KV cache: slow, but every step is plain transformers."""

    def __init__(self, model: Path, dtype: str, tokenizer: Any, **model_kwargs: Any) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype, **model_kwargs)
        self.model.eval()
        self.tokenizer = tokenizer
        self.stop_ids = self._eos_ids()

    def _eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        return {i for i in ids if i is not None}

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[Output]:
        """Generate for token-id prompts, in order, with vLLM's stopping rules."""
        unsupported = set(sampling) - SUPPORTED_SAMPLING
        if unsupported:
            raise ValueError(
                f"backend='hf' does not support sampling options {sorted(unsupported)}; "
                f"it supports {sorted(SUPPORTED_SAMPLING)}"
            )
        return [self._generate_one(ids, sampling) for ids in prompts]

    @torch.inference_mode()
    def _generate_one(self, prompt: list[int], sampling: dict[str, Any]) -> Output:
        temperature = float(sampling.get("temperature", 1.0))
        generator = torch.Generator().manual_seed(int(sampling.get("seed") or 0))
        stop = set() if sampling.get("ignore_eos") else set(self.stop_ids)
        stop.update(sampling.get("stop_token_ids") or [])
        tokens: list[int] = []
        cache = None
        step_input = torch.tensor([prompt])
        for _ in range(int(sampling.get("max_tokens", 16))):
            out = self.model(input_ids=step_input, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits = out.logits[0, -1].float()
            if temperature == 0.0:
                token = int(torch.argmax(logits))
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            tokens.append(token)
            if token in stop:
                break
            step_input = torch.tensor([[token]])
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return Output(prompt_token_ids=list(prompt), token_ids=tokens, text=text)

    def shutdown(self) -> None:
        """Nothing runs in the background; drop the weights."""
        self.model = None
