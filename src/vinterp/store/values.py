"""Site values in a dataset's columns, bit for bit in the stored dtype. Arrow has no bfloat16:
a bfloat16 value is stored as its 2-byte bit pattern in a uint16 column, and `site_tensor`
reads a column back as a torch tensor of the stored dtype (`site_shards`: one memory-mapped
tensor per shard). An SAE's top-k features are two columns, `<site>.indices` (int32) and
`<site>.values` (the stored dtype)."""

from __future__ import annotations

import mmap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from vinterp.store.manifest import MANIFEST, Manifest

STORED_DTYPES = ("float32", "float16", "bfloat16")
# The Arrow (numpy) dtype of a site column per stored dtype.
COLUMN_DTYPE = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}
INDEX_DTYPE = "int32"  # the column of an SAE's top-k feature indices
ROW_COLUMNS = ("prompt", "position", "token")  # a row's own columns, before the sites'


def column_values(tensor: torch.Tensor, dtype: str) -> np.ndarray:
    """A (rows, H) tensor of any float dtype in the stored `dtype`, as the numpy array its
    column holds (bfloat16: the bits as uint16). A CPU tensor already in `dtype` is not
    copied."""
    if dtype not in STORED_DTYPES:
        raise ValueError(f"dtype: expected one of {STORED_DTYPES}, got {dtype!r}")
    values = tensor.detach().to(device="cpu", dtype=getattr(torch, dtype))
    if dtype == "bfloat16":
        return values.view(torch.int16).numpy().view(np.uint16)
    return values.numpy()


def site_tensor(data: str | Path | Any, site: str) -> torch.Tensor:
    """The (rows, H) values of one site of a dataset directory, in its stored dtype
    (`manifest.json`'s spec "dtype"; bfloat16 from its stored bits), rows in stored order;
    for an SAE's top-k columns (`<site>.indices`, `<site>.values`) (rows, k), the indices
    as int32.

    `data` is the directory, or a `datasets.Dataset` loaded from it with all its rows in
    order. A dataset of one shard gives a tensor over the memory-mapped file without a copy
    (`site_shards`); several shards are concatenated into one tensor in memory."""
    pieces = site_shards(data, site)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def site_shards(data: str | Path | Any, site: str) -> list[torch.Tensor]:
    """One site's values as (rows, H) tensors of the stored dtype, one per shard in stored
    order (at least one), each over its memory-mapped file without a copy: a dataset larger
    than host memory is read as the pages are touched. The maps are private (copy-on-write):
    writing to a tensor never changes the file."""
    root = dataset_dir(data)
    manifest = Manifest.read(root / MANIFEST)
    dtype = manifest.spec.get("dtype")
    if dtype not in STORED_DTYPES:
        raise ValueError(f"{root}: the manifest's spec has dtype {dtype!r}, not a stored dtype")
    spec_sites = list(manifest.spec.get("sites", []))
    # the site columns as the manifest lists them (an SAE's features: its top-k pair)
    listed = manifest.about.get("columns") or dict.fromkeys(spec_sites, COLUMN_DTYPE[dtype])
    sites = [name for name in listed if name not in ROW_COLUMNS]
    if site not in sites:
        raise KeyError(f"{root} has no site {site!r}; its sites: {', '.join(sites)}")
    if listed[site] == INDEX_DTYPE:
        dtype = INDEX_DTYPE
    if not isinstance(data, (str, Path)):
        rows = manifest.totals()["rows"]
        if len(data) != rows or getattr(data, "_indices", None) is not None:
            raise ValueError(
                f"the dataset does not hold the {rows} rows of {root} in stored order (a "
                "select, shuffle or filter maps them); pass the directory instead"
            )
    pieces = [
        chunk_tensor(chunk, dtype, root / shard.file)
        for shard in manifest.shards
        for chunk in read_shard(root / shard.file).column(site).chunks
    ]
    width = int(manifest.spec["hidden_size"] if site in spec_sites else manifest.spec["topk"])
    return pieces or [torch.empty((0, width), dtype=getattr(torch, dtype))]


def dataset_dir(data: str | Path | Any) -> Path:
    """The directory of a path, or of the files a `datasets.Dataset` was loaded from."""
    if isinstance(data, (str, Path)):
        return Path(data)
    files = getattr(data, "cache_files", None)
    if files is None:
        raise TypeError(
            f"expected a dataset directory or a datasets.Dataset, got {type(data).__name__}"
        )
    folders = {Path(f["filename"]).parent for f in files}
    if len(folders) != 1:
        raise ValueError(
            "expected a datasets.Dataset loaded from one dataset directory "
            f"(datasets.load_from_disk(DIR)); its files lie in {sorted(map(str, folders))}"
        )
    return folders.pop()


def read_shard(path: Path) -> pa.Table:
    """A shard's table over a private (copy-on-write) memory map of its file."""
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    return pa.ipc.open_stream(pa.py_buffer(mapped)).read_all()


def chunk_tensor(chunk: pa.Array, dtype: str, path: Path) -> torch.Tensor:
    """One Arrow chunk of a site column as a (rows, H) tensor over the same memory."""
    want = pa.from_numpy_dtype(np.dtype(COLUMN_DTYPE.get(dtype, dtype)))
    if not pa.types.is_fixed_size_list(chunk.type) or chunk.type.value_type != want:
        raise ValueError(
            f"{path}: the column holds {chunk.type}, expected fixed-size lists of {want} for "
            f"stored dtype {dtype}"
        )
    flat = chunk.flatten().to_numpy(zero_copy_only=True)
    if dtype == "bfloat16":
        flat = flat.view(np.int16)
    with warnings.catch_warnings():
        # Arrow marks its buffers read-only; the private map takes writes without the file.
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        values = torch.from_numpy(flat)
    if dtype == "bfloat16":
        values = values.view(torch.bfloat16)
    return values.view(-1, chunk.type.list_size)
