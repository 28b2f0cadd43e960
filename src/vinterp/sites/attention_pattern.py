"""The `layers.{i}.attn.pattern` site: attention probabilities computed when a trace reads them.

Neither engine materializes attention probabilities (vLLM's paged kernels never do), so the
site's value is a `Pattern`: one request's queries of the step and every key it attends to,
with the layer's scaling, logit soft-capping and sliding window as the model applies them.
Reading rows of it (`pattern[h]`, `pattern[:, -1]`) computes only those rows; anything else
computes the whole (heads, T_q, T_k) pattern, T_k the request's positions up to its last
query. The math is the eager reference (scores in fp32, soft-cap, causal and window mask,
softmax), never an attention kernel's, so it does not depend on the attention backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True)
class PatternMath:
    """How a layer turns scores into probabilities: its scale, logit soft-cap (None: none)
    and sliding window (a query at p attends to keys at p - window + 1 .. p; None: all)."""

    scale: float
    softcap: float | None = None
    window: int | None = None


@dataclass(frozen=True)
class Pattern:
    """One request's attention pattern at one layer and step, computed on demand.

    `query`: (T_q, heads, head_dim) at `positions`; `keys`: (T_k', kv_heads, head_dim) of the
    positions `key_start` .. `key_start + T_k' - 1` (a sliding-window cache may hold only the
    window: the columns before `key_start` are zeros, as the mask makes them)."""

    query: torch.Tensor
    keys: torch.Tensor
    positions: torch.Tensor
    math: PatternMath
    key_start: int = 0

    @property
    def shape(self) -> torch.Size:
        heads, queries = self.query.shape[1], self.query.shape[0]
        return torch.Size((heads, queries, self.key_start + self.keys.shape[0]))

    def copied(self) -> Pattern:
        """A pattern of its own tensors (the engines reuse theirs in place)."""
        return replace(self, query=self.query.detach().clone(), keys=self.keys.detach().clone())

    def full(self) -> torch.Tensor:
        """(heads, T_q, T_k) float32."""
        return self._rows(torch.arange(self.shape[0]), torch.arange(self.shape[1]))

    def row(self, query: int, heads: Sequence[int] | None = None) -> torch.Tensor:
        """(heads, T_k): one query's row (an index among the T_q), of `heads` (None: all)."""
        chosen = torch.arange(self.shape[0]) if heads is None else torch.tensor(list(heads))
        return self._rows(chosen, torch.tensor([query % self.shape[1]]))[:, 0]

    def __getitem__(self, index: Any) -> torch.Tensor:
        """`pattern[index]`, computing only the heads and queries an int or slice picks in the
        first two places; other indexes (tensors, Ellipsis, None) index the whole pattern."""
        parts = index if isinstance(index, tuple) else (index,)
        picks, rest = parts[:2], parts[2:]
        if not all(isinstance(p, (int, slice)) for p in picks):
            return self.full()[index]
        heads, queries = (
            torch.arange(size)[pick]
            for size, pick in zip(self.shape[:2], (*picks, slice(None), slice(None)))
        )
        block = self._rows(heads.reshape(-1), queries.reshape(-1))
        kept = tuple(0 if isinstance(p, int) else slice(None) for p in picks)
        return block[(*kept, *rest)]

    def _rows(self, heads: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """(len(heads), len(queries), T_k) for the chosen heads and queries."""
        device = self.query.device
        heads, queries = heads.to(device), queries.to(device)
        per_kv = self.query.shape[1] // self.keys.shape[1]  # grouped-query attention
        query = self.query[queries][:, heads].transpose(0, 1).float()
        keys = self.keys[:, torch.div(heads, per_kv, rounding_mode="floor")]
        scores = torch.bmm(query, keys.permute(1, 2, 0).float()) * self.math.scale
        if self.math.softcap is not None:
            scores = torch.tanh(scores / self.math.softcap) * self.math.softcap
        query_at = self.positions.to(device)[queries][:, None]
        key_at = self.key_start + torch.arange(self.keys.shape[0], device=device)[None, :]
        attended = key_at <= query_at
        if self.math.window is not None:
            attended &= key_at > query_at - self.math.window
        probs = torch.softmax(scores.masked_fill(~attended, float("-inf")), dim=-1)
        return torch.nn.functional.pad(probs, (self.key_start, 0))
