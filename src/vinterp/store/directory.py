"""One dataset directory: created for a spec, or reopened for the same spec to continue after
its last finished shard. A shard is committed in three atomic steps: its file under its
final name, the manifest that lists it (the commit point), the `state.json` that
`datasets.load_from_disk` reads; a kill between any two leaves a directory that the next
open puts right (a file the manifest does not list is removed and written again)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from vinterp.store import files, hf_format
from vinterp.store.manifest import (
    MANIFEST,
    Manifest,
    ShardEntry,
    ShardSizes,
    SpecMismatchError,
    StoreError,
    spec_differences,
)

DATA_PREFIX = "data-"
DATA_SUFFIX = ".arrow"


def shard_name(index: int) -> str:
    return f"{DATA_PREFIX}{index:05d}{DATA_SUFFIX}"


class ActivationStore:
    """The manifest and the files of one directory; `write` then `add` adds a shard."""

    def __init__(self, root: Path, manifest: Manifest, columns: hf_format.Columns) -> None:
        self.root = root
        self.manifest = manifest
        self.columns = columns
        self.bytes_written = 0  # by this process

    @classmethod
    def open(
        cls,
        root: str | Path,
        spec: dict[str, Any],
        columns: hf_format.Columns,
        sizes: ShardSizes,
        about: dict[str, Any] | None = None,
    ) -> ActivationStore:
        """Create the dataset in `root`, or reopen the one there if its spec is `spec` (its
        shard sizes are kept, so a restart cuts the same shards). SpecMismatchError for another
        spec or a folder holding other files, StoreError when it cannot be written."""
        root = Path(root)
        spec = json.loads(json.dumps(spec))  # the form it takes in the manifest
        try:
            root.mkdir(parents=True, exist_ok=True)
            path = root / MANIFEST
            if path.exists():
                manifest = Manifest.read(path)
                found = spec_differences(manifest.spec, spec)
                if found:
                    raise SpecMismatchError(
                        f"{root} holds activations of another spec; use another directory, or "
                        "delete this one to start over. Differences:\n  " + "\n  ".join(found)
                    )
                store = cls(root, manifest, columns)
                store.tidy()
                return store
            others = sorted(p.name for p in root.iterdir())
            if others:
                raise SpecMismatchError(
                    f"{root} is not empty and holds no {MANIFEST} (found {others[:5]}); "
                    "give an empty or new directory"
                )
            store = cls(root, Manifest(spec, sizes, about or {}), columns)
            description = f"vinterp activations; spec in {MANIFEST}"
            files.write_json(
                root / hf_format.DATASET_INFO, hf_format.dataset_info(columns, description)
            )
            store.save()
            return store
        except StoreError:
            raise
        except OSError as exc:
            raise StoreError(f"cannot write the dataset at {root}: {exc}") from exc

    def tidy(self) -> None:
        """Remove what a killed run left: temporaries and shard files the manifest does not
        list; rewrite state.json from the manifest."""
        listed = {s.file for s in self.manifest.shards}
        for path in self.root.iterdir():
            temporary = path.name.startswith(".") and path.name.endswith(files.TMP_SUFFIX)
            unlisted = path.name.startswith(DATA_PREFIX) and path.name not in listed
            if temporary or unlisted:
                path.unlink()
        files.write_json(self.root / hf_format.STATE, self.state())

    def state(self) -> dict[str, Any]:
        shards = [s.file for s in self.manifest.shards]
        key = json.dumps([self.manifest.spec, shards]).encode()
        return hf_format.state(shards, hashlib.sha256(key).hexdigest()[:16])

    def save(self) -> None:
        """The manifest, then state.json (load_from_disk then sees only listed shards)."""
        files.write_json(self.root / MANIFEST, self.manifest.to_json())
        files.write_json(self.root / hf_format.STATE, self.state())

    def write(
        self,
        index: int,
        start: int,
        end: int,
        values: dict[str, np.ndarray],
        counts: dict[str, int],
    ) -> ShardEntry:
        """Write shard number `index` (prompts [start, end)) to its file, not yet listed:
        shards may be written in any order, on several threads; `add` lists them in order.
        A file written but never listed is removed when the directory is opened again."""
        rows = hf_format.check_columns(self.columns, values)
        name = shard_name(index)
        try:
            size = files.write_atomic(
                self.root / name, lambda f: hf_format.write_shard(f, self.columns, values)
            )
        except OSError as exc:
            raise self._write_error(name, exc) from exc
        return ShardEntry(name, start, end, rows, size, dict(counts))

    def add(self, entries: list[ShardEntry]) -> None:
        """List written shards (each following the one before) with one manifest save."""
        expected = self.manifest.next_prompt
        for k, entry in enumerate(entries):
            if entry.start != expected or entry.end < entry.start:
                raise ValueError(
                    f"shard [{entry.start}, {entry.end}) does not follow prompt {expected}"
                )
            if entry.file != shard_name(len(self.manifest.shards) + k):
                raise ValueError(f"shard {entry.file} is not shard {len(self.manifest.shards) + k}")
            expected = entry.end
        self.manifest.shards += entries
        try:
            self.save()
        except OSError as exc:
            del self.manifest.shards[-len(entries) :]
            raise self._write_error(entries[-1].file, exc) from exc
        self.bytes_written += sum(entry.bytes for entry in entries)

    def _write_error(self, name: str, exc: OSError) -> StoreError:
        return StoreError(
            f"cannot write shard {name} in {self.root}: {exc}; the finished shards stay "
            "valid, and the same extraction run again continues after them"
        )

    def finish(self) -> None:
        """Mark the dataset complete."""
        self.manifest.complete = True
        try:
            self.save()
        except OSError as exc:
            raise StoreError(f"cannot write the manifest in {self.root}: {exc}") from exc
