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


@dataclass(frozen=True)
class ShardSizes:
    """How prompts are grouped into shards (kept in the manifest, so a restart cuts the same):
    rows fitting `bytes` (a longer prompt is a shard alone), prompts within `tokens` where set;
    the prompts of the last `tail_tokens` computed tokens, where set, in shards of
    `tail_bytes`, so the shards still being written when the engine finishes are small and
    their writes end soon after it."""

    bytes: int
    tokens: int | None = None
    tail_tokens: int | None = None
    tail_bytes: int | None = None


@dataclass
class Manifest:
    spec: dict[str, Any]
    sizes: ShardSizes
    about: dict[str, Any] = field(default_factory=dict)
    shards: list[ShardEntry] = field(default_factory=list)
    complete: bool = False

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
            "shard_bytes": self.sizes.bytes,
            "shard_tokens": self.sizes.tokens,
            "tail_tokens": self.sizes.tail_tokens,
            "tail_shard_bytes": self.sizes.tail_bytes,
            "shards": [asdict(s) for s in self.shards],
        }

    @classmethod
    def read(cls, path: Path) -> Manifest:
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT!r}")
            sizes = ShardSizes(
                int(data["shard_bytes"]),
                data.get("shard_tokens"),
                data.get("tail_tokens"),
                data.get("tail_shard_bytes"),
            )
            return cls(
                data["spec"],
                sizes,
                data.get("about", {}),
                [ShardEntry(**s) for s in data["shards"]],
                bool(data["complete"]),
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
