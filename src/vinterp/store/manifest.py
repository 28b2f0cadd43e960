"""`manifest.json`: what a dataset directory holds. The `spec` says what the rows are (the same
spec gives the same rows), `shards` lists the finished shards in prompt order; a shard exists
for the dataset only once the manifest lists it, so the manifest is the commit point of
every shard and a restart continues after the last one listed."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vinterp.errors import VinterpError

FORMAT = "vinterp-activations/1"
MANIFEST = "manifest.json"


class StoreError(VinterpError, OSError):
    """The dataset directory cannot be read or written (an unwritable path, a full disk).
    Shards the manifest lists stay valid; running the same extraction again resumes."""


class SpecMismatchError(VinterpError, ValueError):
    """The directory holds a dataset of another spec (or something that is no dataset)."""


@dataclass
class ShardEntry:
    """One finished shard: its file, the prompts [start, end) it covers, its rows and bytes,
    and the caller's per-shard counts (summed into the manifest's totals)."""

    file: str
    start: int
    end: int
    rows: int
    bytes: int
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class Manifest:
    spec: dict[str, Any]
    shard_bytes: int  # a shard's rows fit this many bytes (a longer prompt is a shard alone)
    about: dict[str, Any] = field(default_factory=dict)
    shards: list[ShardEntry] = field(default_factory=list)
    complete: bool = False
    shard_tokens: int | None = None  # and its prompts this many tokens, where set

    @property
    def next_prompt(self) -> int:
        """The first prompt no finished shard covers."""
        return self.shards[-1].end if self.shards else 0

    def totals(self) -> dict[str, int]:
        """Rows, bytes, shards and the summed per-shard counts."""
        out = {"shards": len(self.shards), "rows": 0, "bytes": 0, "prompts_done": self.next_prompt}
        for shard in self.shards:
            out["rows"] += shard.rows
            out["bytes"] += shard.bytes
            for key, value in shard.counts.items():
                out[key] = out.get(key, 0) + value
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "complete": self.complete,
            "spec": self.spec,
            "about": self.about,
            "totals": self.totals(),
            "shard_bytes": self.shard_bytes,
            "shard_tokens": self.shard_tokens,
            "shards": [asdict(s) for s in self.shards],
        }

    @classmethod
    def read(cls, path: Path) -> Manifest:
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT!r}")
            return cls(
                data["spec"],
                int(data["shard_bytes"]),
                data.get("about", {}),
                [ShardEntry(**s) for s in data["shards"]],
                bool(data["complete"]),
                data.get("shard_tokens"),
            )
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc}") from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise SpecMismatchError(f"{path} is not a vinterp dataset manifest: {exc}") from None


def spec_differences(found: Any, wanted: Any, prefix: str = "") -> list[str]:
    """Each field where two specs differ, as 'name: value in the directory, value now'."""
    if isinstance(found, dict) and isinstance(wanted, dict):
        out = []
        for key in sorted(set(found) | set(wanted), key=str):
            name = f"{prefix}.{key}" if prefix else str(key)
            out += spec_differences(found.get(key), wanted.get(key), name)
        return out
    if found == wanted:
        return []
    return [f"{prefix or 'spec'}: {found!r} in the directory, {wanted!r} now"]
