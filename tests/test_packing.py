"""Corpora packed into windows without an engine: the windows equal those SAELens's
activation store cuts (its own `concat_and_batch_sequences`, the reference), from every kind
of corpus alike; token-id prompts are taken as they are, and bad ones are refused."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sae_lens.tokenization_and_batching import concat_and_batch_sequences
from transformers import AutoTokenizer

import vinterp
from vinterp.extraction.packing import windows
from vinterp.extraction.prompts import prompt_source, tokenize

BOS = 0
TEXTS = [
    "The capital of France is Paris.",
    "Once upon a time there was a small model that read the residual stream",
    "",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10",
    "def hello(world): return world + 1",
] * 3


def saelens(documents: list[list[int]], context_size: int, bos: bool) -> list[list[int]]:
    """SAELens's windows of token-id documents, as its store calls it with prepend_bos."""
    first = BOS if bos else None
    tensors = (torch.tensor(doc, dtype=torch.long) for doc in documents if doc)
    cut = concat_and_batch_sequences(
        tensors, context_size, begin_batch_token_id=first, sequence_separator_token_id=first
    )
    return [window.tolist() for window in cut]


@settings(max_examples=300, deadline=None)
@given(
    documents=st.lists(st.lists(st.integers(0, 5), max_size=40), min_size=0, max_size=12),
    context_size=st.integers(2, 17),
    bos=st.booleans(),
)
def test_windows_equal_saelenss(documents: list[list[int]], context_size: int, bos: bool) -> None:
    """Documents of ids 0..5 (0 the BOS: documents that start with it, BOS in the middle)."""
    tokenizer = SimpleNamespace(bos_token_id=BOS)
    got = list(windows(documents, tokenizer, context_size, bos))
    assert got == saelens(documents, context_size, bos)
    assert all(len(window) == context_size for window in got)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(vinterp.models.tiny("llama")))


def test_texts_are_tokenized_without_special_tokens_and_cut_as_saelens_cuts(tokenizer) -> None:
    docs = [tokenizer(t, add_special_tokens=False).input_ids for t in TEXTS]
    bos = tokenizer.bos_token_id
    tensors = (torch.tensor(d) for d in docs if d)
    want = [
        w.tolist()
        for w in concat_and_batch_sequences(
            tensors, 16, begin_batch_token_id=bos, sequence_separator_token_id=bos
        )
    ]
    assert len(want) > 3
    assert list(windows(TEXTS, tokenizer, 16)) == want


def test_every_corpus_form_gives_the_same_windows(tokenizer, tmp_path: Path) -> None:
    want = list(windows(TEXTS, tokenizer, 16))
    table = datasets.Dataset.from_dict({"body": TEXTS})
    table.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "shards").mkdir()
    table.select(range(7)).to_parquet(str(tmp_path / "shards" / "a.parquet"))
    table.select(range(7, len(TEXTS))).to_parquet(str(tmp_path / "shards" / "b.parquet"))
    table.to_parquet(str(tmp_path / "one.parquet"))
    streamed = datasets.Dataset.from_dict({"body": TEXTS}).to_iterable_dataset()
    corpora = [
        TEXTS,
        table,
        streamed,
        tmp_path / "saved",
        tmp_path / "shards",
        tmp_path / "one.parquet",
    ]
    for corpus in corpora:
        column = "text" if corpus is TEXTS else "body"
        source = prompt_source(vinterp.Packed(corpus, 16, column=column), tokenizer=tokenizer)
        assert source.count == len(want), corpus
        assert [ids for _, ids in tokenize(tokenizer, source, 0)] == want, corpus
        assert source.sha256 == prompt_source(vinterp.Packed(TEXTS, 16), tokenizer=tokenizer).sha256
    other = prompt_source(vinterp.Packed(TEXTS, 17), tokenizer=tokenizer)
    assert other.sha256 != source.sha256  # another cut is another input


def test_token_id_prompts_are_taken_as_they_are(tokenizer) -> None:
    source = prompt_source([[5, 6, 7], "a text", [9]])
    assert source.count == 3
    assert [ids for _, ids in tokenize(tokenizer, source, 1)] == [
        tokenizer("a text").input_ids,
        [9],
    ]
    assert prompt_source([[5, 6, 7]]).sha256 != prompt_source(["\x05\x06\x07"]).sha256


@pytest.mark.parametrize(
    "prompts, error, message",
    [
        ([[1, 2], []], ValueError, "prompt 1 of the list of 2 prompts has no token ids"),
        ([[1, -2]], TypeError, r"prompt 0: expected a string or a list of token ids"),
        ([[1.5]], TypeError, r"prompt 0: expected a string or a list of token ids"),
        ([["a"]], TypeError, r"prompt 0: expected a string or a list of token ids"),
    ],
)
def test_bad_token_id_prompts_name_the_prompt(prompts, error, message) -> None:
    with pytest.raises(error, match=message):
        prompt_source(prompts)


def test_bad_packings_are_refused(tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="context_size: expected a whole number >= 2"):
        vinterp.Packed(TEXTS, 1)
    with pytest.raises(ValueError, match="the dataset has no column 'body'"):
        prompt_source(
            vinterp.Packed(datasets.Dataset.from_dict({"text": TEXTS}), 8, "body"),
            tokenizer=tokenizer,
        )
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither a folder saved by datasets"):
        prompt_source(vinterp.Packed(tmp_path / "empty", 8), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="holds no prompts"):
        prompt_source(vinterp.Packed(["short"], 64), tokenizer=tokenizer)
    no_bos = SimpleNamespace(bos_token_id=None)
    with pytest.raises(ValueError, match="no BOS token; pack with bos=False"):
        list(windows([[1, 2, 3]], no_bos, 2))
    assert list(windows([[1, 2, 3]], no_bos, 2, bos=False)) == [[1, 2]]
