"""Prompts for `llm.extract`: strings or token-id lists, from a list, a text file (one prompt
per line), a JSONL file (one object per line, the prompt under `column`), a `datasets`
Dataset or IterableDataset column, a folder saved by `Dataset.save_to_disk` or parquet files
(streamed); or such a corpus packed into windows of tokens (`packing.Packed`). They are read
twice: once up front to count, check and hash them (an empty prompt is refused before
anything runs, and the hash tells a resumed run that the input did not change), then from
the first prompt a resumed run still needs. A prompt's index is its place in the input (a
file's line number minus one; a window's number). `tokenize` turns texts into token ids in
chunks; token ids are taken as they are (no BOS added)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np

from vinterp.extraction.packing import Packed, token_ids, windows

Prompt = str | list[int]


@dataclass
class PromptSource:
    read: Callable[[], Iterator[Prompt]]
    description: str
    count: int = 0
    sha256: str = ""
    window: int | None = None  # every prompt's length, when packed

    def scan(self) -> PromptSource:
        """Count and hash the prompts; TypeError or ValueError naming the first bad one."""
        digest = hashlib.sha256()
        count = 0
        for count, prompt in enumerate(self.read(), 1):
            digest.update(_prompt_bytes(prompt, count - 1, self.description))
        if count == 0:
            raise ValueError(f"{self.description} holds no prompts")
        self.count, self.sha256 = count, digest.hexdigest()
        return self

    def from_index(self, start: int) -> Iterator[tuple[int, Prompt]]:
        """(index, prompt) of every prompt from `start` on."""
        for index, prompt in enumerate(self.read()):
            if index >= start:
                yield index, prompt


def _prompt_bytes(prompt: Any, index: int, description: str) -> bytes:
    """What the hash takes of a prompt (its kind, length and content); the checks."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"prompt {index} of {description} is empty")
        data = prompt.encode()
        return b"s" + len(data).to_bytes(8, "little") + data
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        if not prompt:
            raise ValueError(f"prompt {index} of {description} has no token ids")
        return b"i" + len(prompt).to_bytes(8, "little") + np.asarray(prompt, np.int64).tobytes()
    raise TypeError(
        f"prompt {index}: expected a string or a list of token ids (ints >= 0), "
        f"got {type(prompt).__name__}"
    )


def prompt_source(prompts: Any, column: str = "text", tokenizer: Any = None) -> PromptSource:
    """The checked source of `prompts` (see the module docstring); a source already checked
    is passed through (`vinterp extract` checks its file before the engine starts). A
    `Packed` corpus needs the engine's `tokenizer`."""
    if isinstance(prompts, PromptSource):
        return prompts
    if isinstance(prompts, Packed):
        if tokenizer is None:
            raise ValueError("prompts: a Packed corpus is cut with the engine's tokenizer")
        read, description = _texts(prompts.corpus, prompts.column)
        return PromptSource(
            lambda: windows(read(), tokenizer, prompts.context_size, prompts.bos),
            f"{description} packed into {prompts.context_size}-token windows",
            window=prompts.context_size,
        ).scan()
    read, description = _texts(prompts, column)
    return PromptSource(read, description).scan()


def _texts(prompts: Any, column: str) -> tuple[Callable[[], Iterator[Any]], str]:
    """How to read the prompts of any form the module docstring names, and their name."""
    if isinstance(prompts, (list, tuple)):
        items = list(prompts)
        return lambda: iter(items), f"the list of {len(items)} prompts"
    if isinstance(prompts, (str, Path)):
        path = Path(prompts)
        if path.is_dir():
            return _folder(path, column)
        if not path.is_file():
            raise FileNotFoundError(
                f"prompts: no file {str(prompts)[:80]!r}; give a list of strings or token "
                "ids, a text file (one prompt per line), a .jsonl file, parquet files, a "
                "saved datasets folder or a datasets.Dataset"
            )
        if path.suffix == ".jsonl":
            return lambda: _jsonl_texts(path, column), str(path)
        if path.suffix == ".parquet":
            return _parquet([path], column, str(path))
        return lambda: _lines(path), str(path)
    import datasets

    if isinstance(prompts, (datasets.Dataset, datasets.IterableDataset)):
        names = prompts.column_names
        if names is not None and column not in names:
            raise ValueError(f"prompts: the dataset has no column {column!r} ({names})")
        return lambda: _dataset_texts(prompts, column), f"the dataset's {column!r} column"
    raise TypeError(
        f"prompts: expected a list of strings or token ids, a file path or a "
        f"datasets.Dataset, got {type(prompts).__name__}"
    )


def _folder(path: Path, column: str) -> tuple[Callable[[], Iterator[Any]], str]:
    """A folder saved by `Dataset.save_to_disk` (memory-mapped) or of parquet files."""
    import datasets

    if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
        try:
            saved = datasets.load_from_disk(str(path))
        except (OSError, ValueError) as exc:
            raise ValueError(f"prompts: {path} is not a saved dataset ({exc})") from None
        if isinstance(saved, datasets.DatasetDict):
            raise ValueError(
                f"prompts: {path} holds splits {list(saved)}; give the folder of one split"
            )
        read, _ = _texts(saved, column)
        return read, f"{path} ({column!r})"
    files = sorted(path.glob("*.parquet"))
    if not files:
        raise ValueError(
            f"prompts: {path} is neither a folder saved by datasets (state.json) nor one "
            "of parquet files"
        )
    return _parquet(files, column, f"{path} ({len(files)} parquet files)")


def _parquet(
    files: list[Path], column: str, description: str
) -> tuple[Callable[[], Iterator[Any]], str]:
    """Parquet files, streamed (never loaded whole)."""
    import datasets

    def read() -> Iterator[Any]:
        stream = datasets.load_dataset(
            "parquet", data_files=[str(f) for f in files], split="train", streaming=True
        )
        return _dataset_texts(stream, column)

    return read, description


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


def _dataset_texts(dataset: Any, column: str) -> Iterator[Any]:
    """A Dataset's column in batches, an IterableDataset's row by row (streamed)."""
    import datasets

    if isinstance(dataset, datasets.IterableDataset):
        for row in dataset:
            if column not in row:
                raise ValueError(f"prompts: the dataset has no column {column!r} ({list(row)})")
            yield row[column]
        return
    for batch in dataset.select_columns([column]).iter(batch_size=1024):
        yield from batch[column]


def tokenize(tokenizer: Any, source: PromptSource, start: int) -> Iterator[tuple[int, list[int]]]:
    """(index, token ids) from prompt `start` on: texts tokenized in chunks, token ids as
    they are."""
    prompts = (prompt for _, prompt in source.from_index(start))  # indices start, start + 1...
    return zip(count(start), token_ids(prompts, tokenizer, special_tokens=True))
