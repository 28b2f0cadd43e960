"""The files of a Hugging Face `datasets` dataset that `datasets.load_from_disk(DIR)` reads: Arrow
IPC stream shards, `dataset_info.json` (the features) and `state.json` (the shard list), as
`Dataset.save_to_disk` writes them, so the rows load memory-mapped."""

from __future__ import annotations

from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

DATASET_INFO = "dataset_info.json"
STATE = "state.json"
# column name -> (numpy dtype name, width): width None is one value per row, an int a
# fixed-size list of that many values.
Columns = dict[str, tuple[str, int | None]]


def row_size(columns: Columns) -> int:
    """Bytes of one row."""
    return sum(np.dtype(dtype).itemsize * (width or 1) for dtype, width in columns.values())


def features(columns: Columns) -> Any:
    """The `datasets.Features` of these columns."""
    import datasets

    return datasets.Features(
        {
            name: datasets.Value(dtype)
            if width is None
            else datasets.Sequence(datasets.Value(dtype), length=width)
            for name, (dtype, width) in columns.items()
        }
    )


def dataset_info(columns: Columns, description: str) -> dict[str, Any]:
    return {
        "citation": "",
        "description": description,
        "features": features(columns).to_dict(),
        "homepage": "",
        "license": "",
    }


def state(files: list[str], fingerprint: str) -> dict[str, Any]:
    return {
        "_data_files": [{"filename": f} for f in files],
        "_fingerprint": fingerprint,
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }


def check_columns(columns: Columns, values: dict[str, np.ndarray]) -> int:
    """The row count of a shard's arrays; ValueError when they do not fit the columns."""
    if set(values) != set(columns):
        raise ValueError(f"shard columns {sorted(values)}, expected {sorted(columns)}")
    lengths = {len(v) for v in values.values()}
    if len(lengths) != 1:
        raise ValueError(f"shard columns of different lengths {sorted(lengths)}")
    for name, (dtype, width) in columns.items():
        shape = values[name].shape[1:]
        if values[name].dtype != np.dtype(dtype) or shape != (() if width is None else (width,)):
            raise ValueError(
                f"column {name}: {values[name].dtype} {shape}, expected {dtype} of width {width}"
            )
    return lengths.pop()


def write_shard(file: BinaryIO, columns: Columns, values: dict[str, np.ndarray]) -> None:
    """One Arrow stream of these rows (the arrays are not copied on the way)."""
    schema = features(columns).arrow_schema
    arrays = []
    for name, (_, width) in columns.items():
        flat = pa.array(np.ascontiguousarray(values[name]).reshape(-1))
        arrays.append(flat if width is None else pa.FixedSizeListArray.from_arrays(flat, width))
    table = pa.Table.from_arrays(arrays, schema=schema)
    with pa.ipc.new_stream(file, schema) as writer:
        writer.write_table(table)
