"""Prompts for `llm.extract`, from a list of strings, a text file (one prompt per line), a
JSONL file (one object per line, the prompt under `column`) or a `datasets.Dataset` column.
They are read twice: once up front to count, check and hash them (an empty prompt is refused
before anything runs, and the hash tells a resumed run that the input did not change), then
from the first prompt a resumed run still needs. A prompt's index is its place in the input
(a file's line number minus one). `tokenize` turns them into token ids in chunks."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

TOKENIZE_CHUNK = 1024


@dataclass
class PromptSource:
    read: Callable[[], Iterator[str]]
    description: str
    count: int = 0
    sha256: str = ""

    def scan(self) -> PromptSource:
        """Count and hash the prompts; TypeError or ValueError naming the first bad one."""
        digest = hashlib.sha256()
        count = 0
        for count, text in enumerate(self.read(), 1):
            if not isinstance(text, str):
                raise TypeError(f"prompt {count - 1}: expected a string, got {type(text).__name__}")
            if not text:
                raise ValueError(f"prompt {count - 1} of {self.description} is empty")
            data = text.encode()
            digest.update(len(data).to_bytes(8, "little") + data)
        if count == 0:
            raise ValueError(f"{self.description} holds no prompts")
        self.count, self.sha256 = count, digest.hexdigest()
        return self

    def from_index(self, start: int) -> Iterator[tuple[int, str]]:
        """(index, text) of every prompt from `start` on."""
        for index, text in enumerate(self.read()):
            if index >= start:
                yield index, text


def prompt_source(prompts: Any, column: str = "text") -> PromptSource:
    """The checked source of `prompts` (see the module docstring); a source already checked
    is passed through (`vinterp extract` checks its file before the engine starts)."""
    if isinstance(prompts, PromptSource):
        return prompts
    if isinstance(prompts, (list, tuple)):
        items = list(prompts)
        return PromptSource(lambda: iter(items), f"the list of {len(items)} prompts").scan()
    if isinstance(prompts, (str, Path)):
        path = Path(prompts)
        if not path.is_file():
            raise FileNotFoundError(
                f"prompts: no file {str(prompts)[:80]!r}; give a list of strings, a text file "
                "(one prompt per line), a .jsonl file or a datasets.Dataset"
            )
        if path.suffix == ".jsonl":
            return PromptSource(lambda: _jsonl_texts(path, column), str(path)).scan()
        return PromptSource(lambda: _lines(path), str(path)).scan()
    import datasets

    if isinstance(prompts, datasets.Dataset):
        if column not in prompts.column_names:
            raise ValueError(
                f"prompts: the dataset has no column {column!r} ({prompts.column_names})"
            )
        return PromptSource(
            lambda: _dataset_texts(prompts, column), f"the dataset's {column!r} column"
        ).scan()
    raise TypeError(
        f"prompts: expected a list of strings, a file path or a datasets.Dataset, "
        f"got {type(prompts).__name__}"
    )


def _lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as file:
        for line in file:
            yield line.rstrip("\r\n")


def _jsonl_texts(path: Path, column: str) -> Iterator[str]:
    for number, line in enumerate(_lines(path), 1):
        try:
            text = json.loads(line)[column]
        except (ValueError, TypeError, KeyError):
            raise ValueError(
                f"{path} line {number}: expected a JSON object with a {column!r} field"
            ) from None
        yield text


def _dataset_texts(dataset: Any, column: str) -> Iterator[str]:
    for batch in dataset.select_columns([column]).iter(batch_size=1024):
        yield from batch[column]


def tokenize(tokenizer: Any, source: PromptSource, start: int) -> Iterator[tuple[int, list[int]]]:
    """(index, token ids) from prompt `start` on, tokenized in chunks."""
    prompts = source.from_index(start)
    while chunk := list(islice(prompts, TOKENIZE_CHUNK)):
        ids = tokenizer([text for _, text in chunk]).input_ids
        yield from zip((index for index, _ in chunk), ids)
