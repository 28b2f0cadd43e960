"""A text corpus packed into windows of `context_size` tokens, as SAELens's activation store
cuts its training contexts (`concat_and_batch_sequences` with `prepend_bos`).

Each document is tokenized without special tokens and the documents are joined end to end
with a BOS token between two of them; the stream is cut into windows of exactly
`context_size` tokens, each starting with BOS (a document that runs past a window's end goes
on after the next window's BOS). A BOS is never doubled: a document that starts with one
gets no separator, a window whose first token is one gets no other. The last window, shorter
than `context_size`, is dropped. With `bos=False` nothing is inserted: the documents' tokens
are concatenated and cut. The corpus is read as a stream, a chunk of documents at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

TOKENIZE_CHUNK = 1024  # documents tokenized at once


@dataclass(frozen=True)
class Packed:
    """`vinterp.Packed(corpus, context_size)`: extraction's prompts as windows of a corpus
    (the module docstring says how they are cut). `corpus` is what `llm.extract` takes as
    prompts, or a `datasets.IterableDataset`; `column` names the text of a .jsonl file or a
    dataset; `bos=False` joins and cuts the documents' tokens with nothing inserted."""

    corpus: Any
    context_size: int
    column: str = "text"
    bos: bool = True

    def __post_init__(self) -> None:
        size = self.context_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise ValueError(f"context_size: expected a whole number >= 2, got {size!r}")


def windows(
    documents: Iterable[str], tokenizer: Any, context_size: int, bos: bool = True
) -> Iterator[list[int]]:
    """The windows of `documents` (the module docstring's rules)."""
    bos_id = tokenizer.bos_token_id if bos else None
    if bos and bos_id is None:
        raise ValueError("Packed(bos=True): this tokenizer has no BOS token; pack with bos=False")
    window: list[int] = []
    for ids in filter(None, token_ids(documents, tokenizer, special_tokens=False)):
        if bos_id is not None and window and ids[:1] != [bos_id]:
            window.append(bos_id)  # the separator between two documents
        offset = 0
        while offset < len(ids):
            if not window and bos_id is not None and ids[offset] != bos_id:
                window.append(bos_id)  # every window starts with BOS
            take = context_size - len(window)
            window.extend(ids[offset : offset + take])
            offset += take
            if len(window) == context_size:  # (a separator alone may have filled it)
                yield window
                window = []


def token_ids(items: Iterable[Any], tokenizer: Any, special_tokens: bool) -> Iterator[list[int]]:
    """Each item's token ids, texts tokenized a chunk at a time (with or without the
    tokenizer's special tokens), token-id lists as they are; TypeError naming any other."""
    stream, first = iter(items), 0
    while chunk := list(islice(stream, TOKENIZE_CHUNK)):
        texts = [item for item in chunk if isinstance(item, str)]
        encoded = iter(
            tokenizer(texts, add_special_tokens=special_tokens).input_ids if texts else []
        )
        for number, item in enumerate(chunk, first):
            if isinstance(item, str):
                yield next(encoded)
            elif isinstance(item, list) and all(isinstance(t, int) for t in item):
                yield item
            else:
                raise TypeError(
                    f"item {number}: expected a text or a list of token ids, "
                    f"got {type(item).__name__}"
                )
        first += len(chunk)
