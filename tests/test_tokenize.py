"""Prompts tokenized as the engine gets them: the texts of a call in one batch, in order, each
as the model's tokenizer gives it alone (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

import vinterp
from vinterp.api.front_end import TraceFrontEnd
from vinterp.api.llm import LocalModel

TEXTS = [
    "The capital of France is",
    "",
    " leading space and  double  spaces",
    "ünïcödé — and emoji 🙂 too",
    "a long one " * 300,
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(vinterp.models.tiny("llama")))


def test_a_batch_of_texts_gives_each_texts_own_tokens(tokenizer) -> None:
    model = SimpleNamespace(tokenizer=tokenizer)
    alone = [LocalModel.encode(model, text) for text in TEXTS]  # type: ignore[arg-type]
    assert LocalModel.encode_batch(model, TEXTS) == alone  # type: ignore[arg-type]
    assert alone[0] == tokenizer("The capital of France is").input_ids


class Batches(TraceFrontEnd):
    """A front end whose texts can only be tokenized in batches (each is recorded)."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def encode(self, text: str) -> list[int]:
        raise AssertionError("texts are tokenized in one batch")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        self.batches.append(list(texts))
        return [[len(text), ord(text[0])] for text in texts]


def test_texts_go_in_one_batch_and_come_back_in_the_prompts_order() -> None:
    front = Batches()
    got = front.tokenize(["ab", [7, 8, 9], "c", [1], "def"])
    assert front.batches == [["ab", "c", "def"]]
    assert got == [[2, ord("a")], [7, 8, 9], [1, ord("c")], [1], [3, ord("d")]]


def test_token_ids_alone_need_no_tokenizer_and_a_bad_prompt_is_named() -> None:
    front = Batches()
    assert front.tokenize([5, 6]) == [[5, 6]]
    assert front.tokenize([[5], [6, 7]]) == [[5], [6, 7]]
    assert front.batches == []
    with pytest.raises(TypeError, match="a prompt is a string or a list of token ids, got dict"):
        front.tokenize(["a", {"prompt": "b"}])


def test_a_prompt_without_tokens_is_refused_by_its_place() -> None:
    from transformers import AutoConfig

    from vinterp.api.requests import prepare

    front = Batches()
    front.config = AutoConfig.from_pretrained(str(vinterp.models.tiny("llama")))  # type: ignore[attr-defined]
    front.pipeline_parallel_size, front.saes = 1, {}  # type: ignore[attr-defined]
    assert [p.prompt for p in prepare(front, ["ab", [3]], None, None, {})] == [[2, ord("a")], [3]]
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):
        prepare(front, ["ab", [], "c"], None, None, {})
