"""The on-disk activation dataset: Hugging Face `datasets` shards written atomically on a
writer thread, and a manifest that makes a killed run resumable."""

from vinterp.store.directory import ActivationStore
from vinterp.store.files import content_hash
from vinterp.store.hf_format import Columns, row_size
from vinterp.store.manifest import Manifest, SpecMismatchError, StoreError
from vinterp.store.writer import PendingShard, ShardWriter

__all__ = [
    "ActivationStore",
    "Columns",
    "Manifest",
    "PendingShard",
    "ShardWriter",
    "SpecMismatchError",
    "StoreError",
    "content_hash",
    "row_size",
]
