"""The attention pattern's math against transformers' eager attention, and reading rows of a
pattern computes only those rows."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from vinterp.sites.attention_pattern import Pattern, PatternMath

HEADS, KV_HEADS, HEAD_DIM, TOKENS = 6, 2, 16, 20


def eager_weights(q, k, math: PatternMath) -> torch.Tensor:
    """transformers' eager attention probabilities, (heads, T, T), with its causal and
    sliding-window mask built here from the definition (a key j is seen by a query i when
    i - window < j <= i)."""
    i, j = torch.arange(TOKENS)[:, None], torch.arange(TOKENS)[None, :]
    seen = j <= i
    if math.window is not None:
        seen &= j > i - math.window
    mask = torch.zeros(TOKENS, TOKENS).masked_fill(~seen, float("-inf"))
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = HEADS // KV_HEADS, False
    _, weights = eager_attention_forward(
        module,
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        mask[None, None],
        scaling=math.scale,
        softcap=math.softcap,
    )
    return weights[0]


def qk(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(TOKENS, HEADS, HEAD_DIM, generator=g) * 2
    return q, torch.randn(TOKENS, KV_HEADS, HEAD_DIM, generator=g) * 2


MATHS = [
    PatternMath(HEAD_DIM**-0.5),
    PatternMath(0.3, softcap=5.0),
    PatternMath(HEAD_DIM**-0.5, window=7),
    PatternMath(0.2, softcap=2.0, window=4),
]


@pytest.mark.parametrize("math", MATHS, ids=["plain", "softcap", "window", "both"])
def test_full_pattern_equals_eager_attention(math: PatternMath) -> None:
    q, k = qk(0)
    pattern = Pattern(q, k, torch.arange(TOKENS), math)
    want = eager_weights(q, k, math)
    assert pattern.shape == want.shape == (HEADS, TOKENS, TOKENS)
    assert torch.allclose(pattern.full(), want, atol=1e-6)


def test_a_decode_row_over_a_window_cache_equals_the_full_patterns_row() -> None:
    """A decode step's one query over keys that start later (a sliding-window cache): the
    columns before them are zeros, the rest the full pattern's last row."""
    math = PatternMath(HEAD_DIM**-0.5, window=5)
    q, k = qk(1)
    want = eager_weights(q, k, math)[:, -1:]
    held = 6  # the cache keeps the last 6 keys
    row = Pattern(q[-1:], k[-held:], torch.tensor([TOKENS - 1]), math, TOKENS - held)
    assert row.shape == (HEADS, 1, TOKENS)
    assert torch.allclose(row.full(), want, atol=1e-6)


INDEXES = [
    2,
    -1,
    slice(1, 4),
    (slice(None), -1),
    (3, slice(2, 9)),
    (0, 5, 3),
    (slice(None), 4, [1, 2]),
]


@pytest.mark.parametrize("index", INDEXES, ids=str)
def test_rows_read_compute_only_those_rows(index, monkeypatch) -> None:
    math = PatternMath(HEAD_DIM**-0.5, softcap=3.0, window=6)
    q, k = qk(2)
    pattern = Pattern(q, k, torch.arange(TOKENS), math)
    want = pattern.full()[index]
    computed = []
    rows = Pattern._rows

    def counting(self, heads, queries):
        computed.append(len(heads) * len(queries))
        return rows(self, heads, queries)

    monkeypatch.setattr(Pattern, "_rows", counting)
    got = pattern[index]
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
    assert computed and computed[0] < HEADS * TOKENS


def test_other_indexes_index_the_whole_pattern() -> None:
    q, k = qk(3)
    pattern = Pattern(q, k, torch.arange(TOKENS), PatternMath(0.25))
    full = pattern.full()
    for index in (..., (None, 1), torch.tensor([0, 3])):
        assert torch.equal(pattern[index], full[index])


def test_kept_keys_grow_by_steps_and_a_recomputed_request_replaces_them() -> None:
    from vinterp.runtime.attention_keys import KeptKeys

    keys = torch.randn(30, KV_HEADS, HEAD_DIM)
    kept = KeptKeys()
    assert torch.equal(kept.put(0, keys[:13]), keys[:13])  # a prompt
    for position in range(13, 20):  # decode steps, one key each
        assert torch.equal(kept.put(position, keys[position : position + 1]), keys[: position + 1])
    redone = torch.randn(16, KV_HEADS, HEAD_DIM)  # preempted, recomputed from position 4
    assert torch.equal(kept.put(4, redone), torch.cat([keys[:4], redone]))
