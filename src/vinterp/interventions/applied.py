"""Never silent (DESIGN.md lesson 11): with the check on, the compiled site ops count what they
did into device counters, and after each step the runner compares the counts with what the
step asked for. A site missing from the model, a replayed graph without the ops, or tables
written after the forward read them then come back to the caller as an error, not as wrong
results.

Counted on the device, inside the compiled model (so in replayed CUDA graphs as well):
- `steered[site]`: the tokens that got a steering row at the site;
- `gathered[site]`: the gathers of the site's capture buffer.
Counted on the host: the sites whose Python handler ran in a step run uncompiled.

Reading the counters waits for the step to finish, so the check is off by default
(`vinterp.LLM(check_applied=True)`, or VINTERP_CHECK_APPLIED=1).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from vinterp.sites.names import SiteOrder


class AppliedCounters(nn.Module):
    """The device counters, registered on the model (as the steering buffers are), so the
    compiled graph updates them like any buffer it writes."""

    def __init__(self, num_sites: int, device: torch.device | str) -> None:
        super().__init__()
        for name in ("steered", "gathered"):
            counts = torch.zeros(num_sites, dtype=torch.int64, device=device)
            self.register_buffer(name, counts, persistent=False)

    def count_steered(self, site: torch.Tensor, rows: torch.Tensor) -> None:
        """`site`: the site id (one-element tensor); `rows`: each token's steering-table row at the
        site (0: none)."""
        self.steered.index_add_(0, site, (rows != 0).sum().view(1))

    def count_gather(self, site: torch.Tensor) -> None:
        self.gathered.index_add_(0, site, torch.ones_like(self.gathered[:1]))

    def reset(self) -> None:
        self.steered.zero_()
        self.gathered.zero_()


def steered_per_site(token_combo: np.ndarray, site_rows: np.ndarray) -> np.ndarray:
    """Per site, how many tokens a step steers there: the tokens whose combination has a table
    row at the site (`token_combo` is zero past the step's tokens, as on the device)."""
    per_combo = np.bincount(token_combo, minlength=len(site_rows))
    return per_combo @ (site_rows != 0)


class AppliedCheck:
    """One worker's check: expectations and counts per step, messages until taken."""

    MAX_MESSAGES = 100  # a caller that never takes them does not grow the worker's memory

    def __init__(self, counters: AppliedCounters, held: frozenset[int], order: SiteOrder) -> None:
        self.counters = counters
        self.held = np.array(sorted(held), dtype=np.int64)  # the sites this worker's model runs
        self.order = order
        self.visited: set[int] = set()
        self.begun = False
        self.messages: list[str] = []

    def begin(self) -> None:
        """Before the step's forward: counters and visits from zero."""
        self.counters.reset()
        self.visited.clear()
        self.begun = True

    def visit(self, site_id: int) -> None:
        self.visited.add(site_id)

    def end(self, step: int, python: bool, steered: np.ndarray | None, gathers: list[int]) -> None:
        """After the forward: `steered` per site as planned (None: no steering), `gathers` the
        sites whose capture buffers this step's captures read, `python` whether it ran
        uncompiled."""
        if not self.begun:  # the runner had nothing to run this step
            return
        self.begun = False
        held = self.held
        got = self.counters.steered.cpu().numpy()[held]
        want = np.zeros_like(got) if steered is None else steered[held]
        for site_id, n, expected in zip(held.tolist(), got.tolist(), want.tolist()):
            if n != expected:
                self._report(
                    f"step {step}: steering at {self.order.sites[site_id]} reached {n} of "
                    f"the {expected} tokens it steers"
                )
        gathered = self.counters.gathered.cpu().numpy()
        missed = [self.order.sites[s] for s in gathers if gathered[s] == 0]
        if missed:
            self._report(
                f"step {step}: the compiled model did not gather the captured rows at "
                + ", ".join(missed)
            )
        if python:
            skipped = [self.order.sites[s] for s in held.tolist() if s not in self.visited]
            if skipped:
                self._report(
                    f"step {step} ran uncompiled, but the sites' Python handlers did not run "
                    f"at {', '.join(skipped)}"
                )

    def _report(self, message: str) -> None:
        if len(self.messages) < self.MAX_MESSAGES:
            self.messages.append(message)

    def take(self) -> list[str]:
        """The messages since the last take."""
        messages, self.messages = self.messages, []
        return messages
