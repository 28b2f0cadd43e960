"""The on-disk activation dataset: Hugging Face `datasets` shards written atomically on a
writer thread, a manifest that makes a killed run resumable, and the site values read back
bit for bit in their stored dtype."""

from vinterp.store.directory import ActivationStore
from vinterp.store.hf_format import Columns, row_size
from vinterp.store.lister import FAILED, InOrderLister
from vinterp.store.manifest import (
    Manifest,
    ShardEntry,
    ShardSizes,
    SpecMismatchError,
    StoreError,
)
from vinterp.store.values import (
    COLUMN_DTYPE,
    INDEX_DTYPE,
    ROW_COLUMNS,
    STORED_DTYPES,
    column_values,
    site_shards,
    site_tensor,
)
from vinterp.store.writer import WRITER_THREADS, PendingShard, ShardWriter

__all__ = [
    "COLUMN_DTYPE",
    "INDEX_DTYPE",
    "ROW_COLUMNS",
    "STORED_DTYPES",
    "WRITER_THREADS",
    "FAILED",
    "ActivationStore",
    "InOrderLister",
    "Columns",
    "Manifest",
    "PendingShard",
    "ShardEntry",
    "ShardSizes",
    "ShardWriter",
    "SpecMismatchError",
    "StoreError",
    "column_values",
    "row_size",
    "site_shards",
    "site_tensor",
]
