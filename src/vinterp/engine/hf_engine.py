"""The transformers backend: the same checkpoint run by HF modules, the reference for checks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from vinterp.engine.backend import Captured, StreamRequest
from vinterp.engine.engine_limits import EngineLimits
from vinterp.engine.hf_interventions import HFInterventions, HFRequest
from vinterp.engine.outputs import Output
from vinterp.interventions.sae_registry import SaeRegistry
from vinterp.ir.graph import Graph
from vinterp.ir.plan import Plan
from vinterp.runtime.executor import TraceResult, TraceRun
from vinterp.sae import SAE
from vinterp.sites.attention_pattern import Pattern
from vinterp.sites.hf_attention import install_head_sites
from vinterp.sites.hf_hooks import install_hf_hooks
from vinterp.sites.modules import find_site_modules, site_order, unhooked
from vinterp.sites.params import hf_param
from vinterp.sites.raw import install_raw_hooks, raw_sites_of
from vinterp.wire.request_specs import RequestSpecs
from vinterp.wire.specs import Steering

SUPPORTED_SAMPLING = {"temperature", "max_tokens", "seed", "ignore_eos", "stop_token_ids"}


class HFEngine:
    """The transformers backend: one prompt at a time with a KV cache; slow, but every step
    is plain transformers."""

    name = "hf"

    def __init__(
        self,
        model: Path,
        dtype: str,
        tokenizer: Any,
        site_paths: dict[str, str] | None = None,
        **model_kwargs: Any,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype, **model_kwargs)
        self.model.eval()
        self.tokenizer = tokenizer
        self.stop_ids = self._eos_ids()
        self.sites = find_site_modules(self.model, self.model.config.model_type, site_paths)
        self._active: tuple[TraceRun, int, int] | None = None  # (run, invoke, step)
        self.saes = SaeRegistry(self.model.device, self.model.dtype)
        self.interventions = HFInterventions(self.saes)
        self.order = site_order(self.model.config)
        self.steps = 0
        install_hf_hooks(self.sites, self._at_site, self.order.router)
        if self.order.heads is not None:
            install_head_sites(self.model, self.sites, self._at_site)

    @property
    def native(self) -> Any:
        return self.model

    def _at_site(self, site: str, value: Any) -> torch.Tensor | None:
        """As in vLLM's workers: steering, capture, then the trace (which sees both)."""
        if isinstance(value, Pattern):
            self.interventions.at_pattern(site, value)
            steered = None
        else:
            steered = self.interventions.at_site(site, value)
        if self._active is None:
            return steered
        run, invoke, step = self._active
        if not run.wants(invoke, site):
            return steered
        traced = run.at_site(invoke, step, site, value if steered is None else steered)
        return steered if traced is None else traced

    def run_trace(self, graph: Graph, plan: Plan, use_tqdm: bool = True) -> TraceResult:
        """Run each invoke alone, rounds in dependency order (the reference semantics)."""
        functions = {
            "final_norm": unhooked(self.sites.final_norm),
            "lm_head": unhooked(self.sites.lm_head),
            "param": lambda name: hf_param(self.sites, name),
            **self.saes.functions(),
        }
        run = TraceRun(graph, plan, functions)
        outputs: list[Output | None] = [None] * len(graph.invokes)
        raw_hooks = install_raw_hooks(self.model, raw_sites_of(graph), self._at_site)
        order = [k for round_ in plan.rounds for k in round_]
        try:
            for k in tqdm(order, desc="invokes", disable=not use_tqdm or len(order) < 2):
                invoke = graph.invokes[k]
                self._check_sampling(invoke.sampling)
                request = self.interventions.request(None, len(invoke.prompt), self.order)
                outputs[k] = self._generate_one(invoke.prompt, invoke.sampling, request, run, k)
        finally:
            for handle in raw_hooks:
                handle.remove()
        return TraceResult(outputs, run.results(), run.failure)

    def _eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        return {i for i in ids if i is not None}

    def generate(
        self,
        prompts: list[list[int]],
        sampling: list[dict[str, Any]],
        specs: list[RequestSpecs | None],
        use_tqdm: bool = True,
    ) -> list[Output]:
        """Generate for token-id prompts, in order, with vLLM's stopping rules."""
        for s in sampling:
            self._check_sampling(s)
        requests = [
            self.interventions.request(r, len(ids), self.order) for ids, r in zip(prompts, specs)
        ]
        items = list(zip(prompts, sampling, requests))
        return [
            self._generate_one(ids, s, request)
            for ids, s, request in tqdm(
                items, desc="prompts", disable=not use_tqdm or len(prompts) < 2
            )
        ]

    def stream(
        self, requests: Iterable[StreamRequest], queued_tokens: int
    ) -> Iterator[tuple[int, Output]]:
        """(index, output) of each request in order (one prompt at a time: nothing queues)."""
        for index, (ids, sampling, specs) in enumerate(requests):
            (output,) = self.generate([ids], [sampling], [specs], use_tqdm=False)
            yield index, output

    def take_captures(self, capture_ids: list[str]) -> Captured:
        """Captured rows per capture id and site, as the vLLM engine gives them."""
        return self.interventions.take(capture_ids)

    def take_captures_later(self, capture_ids: list[str]) -> Callable[[], Captured]:
        taken = self.take_captures(capture_ids)
        return lambda: taken

    def attach_sae(self, site: str, sae: SAE) -> None:
        self.saes.attach(site, sae)

    def set_global_steering(self, steering: list[Steering]) -> None:
        self.interventions.global_steering = list(steering)

    def register_steering(self, name: str, steering: Steering | None) -> None:
        if steering is None:
            self.interventions.named.pop(name, None)
        else:
            self.interventions.named[name] = steering

    def steering_names(self) -> set[str]:
        return set(self.interventions.named)

    def limits(self) -> EngineLimits:
        """Its dtype and longest prompt (the model's positions); no step limits."""
        positions = getattr(self.model.config, "max_position_embeddings", None)
        dtype = str(self.model.dtype).removeprefix("torch.")
        return EngineLimits(dtype, None if positions is None else int(positions) - 1, None)

    def step_stats(self) -> dict[str, int]:
        """Forward steps run so far; none leaves compiled code (nothing is compiled)."""
        return {"steps": self.steps, "uncompiled_steps": 0, "graph_capture_steps": 0}

    @staticmethod
    def _check_sampling(sampling: dict[str, Any]) -> None:
        unsupported = set(sampling) - SUPPORTED_SAMPLING
        if unsupported:
            raise ValueError(
                f"backend='hf' does not support sampling options {sorted(unsupported)}; "
                f"it supports {sorted(SUPPORTED_SAMPLING)}"
            )

    @torch.no_grad()  # not inference_mode: saved tensors must work in autograd afterwards
    def _generate_one(
        self,
        prompt: list[int],
        sampling: dict[str, Any],
        request: HFRequest,
        run: TraceRun | None = None,
        invoke: int = 0,
    ) -> Output:
        temperature = float(sampling.get("temperature", 1.0))
        generator = torch.Generator().manual_seed(int(sampling.get("seed") or 0))
        stop = set() if sampling.get("ignore_eos") else set(self.stop_ids)
        stop.update(sampling.get("stop_token_ids") or [])
        tokens: list[int] = []
        cache = None
        step_input = torch.tensor([prompt])
        for step in range(int(sampling.get("max_tokens", 16))):
            self._active = None if run is None else (run, invoke, step)
            request.first_position = 0 if step == 0 else len(prompt) + step - 1
            self.interventions.current = request
            try:
                out = self.model(input_ids=step_input, past_key_values=cache, use_cache=True)
                self.steps += 1
                cache = out.past_key_values
                logits = out.logits[0, -1:].float()
                replaced = self._at_site("logits", logits)
                logits = logits if replaced is None else replaced
                if temperature == 0.0:
                    token = int(torch.argmax(logits))
                else:
                    probs = torch.softmax(logits[0] / temperature, dim=-1)
                    token = int(torch.multinomial(probs, 1, generator=generator))
                self._at_site("samples", torch.tensor([token]))
            finally:
                self._active = None
                self.interventions.current = None
            tokens.append(token)
            if token in stop:
                break
            step_input = torch.tensor([[token]])
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return Output(prompt_token_ids=list(prompt), token_ids=tokens, text=text)

    def shutdown(self) -> None:
        """Nothing runs in the background; drop the weights."""
        self.model = None
