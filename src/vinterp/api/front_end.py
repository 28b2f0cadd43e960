"""What `vinterp.LLM`, `vinterp.AsyncLLM` and the clients share: the module tree a trace is
written against, the trace context, and the backend that runs both. A subclass sets the
model description (`config`, `pipeline_parallel_size`, `model_name`), `encode` (its
tokenizer) and `backend` (a `vinterp.engine.backend.Backend`, or an `AsyncBackend` where
`asynchronous` is set)."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from vinterp.api.site_points import Layers, ModulePoint, RawPoint, SitePoint
from vinterp.api.trace import Prompt, Trace

# The trace being recorded, per front-end: a context variable, so that concurrent tasks (and
# threads) each record their own trace on one shared model. Never mutated, only replaced.
_RECORDING: ContextVar[dict[int, Trace]] = ContextVar("vinterp_recording", default={})  # noqa: B039


class TraceFrontEnd:
    config: Any
    pipeline_parallel_size: int
    model_name: str  # what capture files name as the model
    backend: Any
    asynchronous = False  # traces run with `async with`, generate is awaited

    def _init_front_end(self) -> None:
        self.layers = Layers(self)
        self.embed = SitePoint(self, "embed")
        self.final_norm = ModulePoint(self, "final_norm", "final_norm")
        self.lm_head = ModulePoint(self, "lm_head", "lm_head")
        self.raw = RawPoint(self)
        self.saes: dict[str, Any] = {}  # host site -> the vinterp.SAE attached there

    def encode(self, text: str) -> list[int]:
        """Token ids of a text prompt (the model's tokenizer)."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, as `encode` gives them; a local tokenizer takes them in one
        call (a fast tokenizer spreads them over the cores)."""
        return [self.encode(text) for text in texts]

    def tokenize(self, prompts: Prompt | list[Prompt]) -> list[list[int]]:
        """Token ids of each prompt (a text, or token ids already); the texts in one batch."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        texts = [prompt for prompt in prompts if isinstance(prompt, str)]  # type: ignore[union-attr]
        encoded = iter(self.encode_batch(texts) if texts else [])
        token_lists = []
        for prompt in prompts:  # type: ignore[union-attr]
            if isinstance(prompt, str):
                token_lists.append(next(encoded))
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                token_lists.append(list(prompt))
            else:
                raise TypeError(
                    f"a prompt is a string or a list of token ids, got {type(prompt).__name__}"
                )
        return token_lists

    def trace(self, prompt: Prompt | None = None, use_tqdm: bool = True, **sampling: Any) -> Trace:
        """Record reads, writes and saves in the `with` body; run them at its exit (with a
        progress bar over the invokes unless `use_tqdm=False`)."""
        return Trace(self, prompt, use_tqdm=use_tqdm, **sampling)

    def begin_trace(self, trace: Trace) -> None:
        """Make `trace` the one this task records into (called at the `with` entry)."""
        recording = _RECORDING.get()
        if id(self) in recording:
            raise RuntimeError("traces on one model cannot be nested")
        _RECORDING.set({**recording, id(self): trace})

    def end_trace(self, trace: Trace) -> None:
        recording = _RECORDING.get()
        if recording.get(id(self)) is trace:
            _RECORDING.set({k: v for k, v in recording.items() if k != id(self)})

    def active_trace(self) -> Trace:
        """The trace this task is recording on this model."""
        trace = _RECORDING.get().get(id(self))
        if trace is None:
            raise RuntimeError("site values exist only inside `with llm.trace(...):`")
        return trace

    def unembed(self, value: Any) -> Any:
        """`lm_head(final_norm(value))` inside a trace: the logit lens."""
        return self.lm_head(self.final_norm(value))

    @property
    def logits(self) -> Any:
        """Logits used to sample this step's token, (1, V)."""
        return self.active_trace().record_read("logits")

    @logits.setter
    def logits(self, value: Any) -> None:
        self.active_trace().record_write("logits", value)

    @property
    def samples(self) -> Any:
        """The token id sampled this step, (1,)."""
        return self.active_trace().record_read("samples")
