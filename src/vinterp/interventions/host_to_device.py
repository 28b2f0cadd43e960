"""Host-to-device copies made while the device runs a step: into the persistent buffers the
compiled model reads, and of the row indices a step's results are gathered with. None of them
waits for the device (a blocking copy would stall the host until the queued step ends, and
the next step's preparation could no longer overlap it)."""

from __future__ import annotations

import torch


def upload(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` into `dst` without waiting for the device (pinned source on a GPU)."""
    if dst.device.type == "cpu":
        dst.copy_(src)
    else:
        dst.copy_(src.pin_memory(), non_blocking=True)


def on_device(src: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`src` on `device`, copied without waiting for the device (pinned source on a GPU)."""
    if device.type == "cpu":
        return src
    return src.pin_memory().to(device, non_blocking=True)
