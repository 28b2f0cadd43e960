"""One tool on one workload: its times, how it compares with vinterp, whether its output
matched, or the exact error that kept it from running."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .timing import Timing


@dataclass
class PeerRow:
    workload: str
    tool: str
    version: str
    timing: Timing | None  # None: the tool did not run
    check: str  # "reference", "ok ...", "WRONG: ...", or the error
    vinterp_median_s: float | None = None

    @property
    def ran(self) -> bool:
        return self.timing is not None

    @property
    def wrong(self) -> bool:
        return self.check.startswith("WRONG")

    @property
    def vs_vinterp(self) -> float | None:
        """How many times longer than vinterp the tool took (above 1: vinterp is faster)."""
        if self.timing is None or not self.vinterp_median_s:
            return None
        return self.timing.median / self.vinterp_median_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "tool": self.tool,
            "version": self.version,
            "timing": self.timing.to_dict() if self.timing else None,
            "vs_vinterp": self.vs_vinterp,
            "check": self.check,
        }
