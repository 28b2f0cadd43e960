"""Captured rows handed from a worker to its front end as files in a directory both can
read (by default under /dev/shm): the worker answers a take at once with each block's file
name and writes the files on a thread of its own; the front end maps each file when it
needs the rows. A large capture then costs a copy into memory on the worker's side and a
mapping on the front end's, instead of travelling inside vLLM's RPC messages (1.1 GB of
rows took 16 s that way on the CPU engine) and holding up the engine's loop meanwhile.

Small blocks, workers on another host (the directory is not theirs) and takes without a
directory travel inline as wire tensors (`wire.tensors`).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from vinterp.wire.errors import WireError
from vinterp.wire.tensors import DTYPES, byte_size, check_shape, tensor_from_wire, tensor_to_wire

DIR_ENV = "VINTERP_CAPTURE_DIR"  # where the front end's handoff directory is made
SHARED_MEMORY = "/dev/shm"
MIN_FREE = 8 << 30  # /dev/shm is used when it has this much room, else the system temp dir
INLINE_BYTES = 1 << 20  # blocks smaller than this travel inline
WAIT_SECONDS = 600.0  # for a file the worker has not finished (its writes are queued)
PART, ERROR = ".part", ".error"
WRITE_THREADS = 4  # files a worker writes at once
STAGING_BYTES = 64 << 20  # pinned host memory per writer thread for rows on a device


def host_key() -> str:
    """This machine (boot id and host name): a worker elsewhere cannot see the directory."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class FileHandoff:
    """The front end's side: a private directory the workers write blocks into, and the
    decoding of the blocks they answer with (`tensor`)."""

    def __init__(self, alive: Callable[[], bool] = lambda: True) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="vinterp-captures-", dir=_root()))
        self.host = host_key()
        self.alive = alive  # False once the workers' engine has died: no file is coming

    def request(self) -> dict[str, str]:
        """What a take sends the workers."""
        return {"directory": str(self.directory), "host": self.host}

    def tensor(self, block: Any, what: str) -> torch.Tensor:
        """A block's values: an inline wire tensor, or the file a worker wrote (mapped, then
        removed: the mapping keeps the rows until the tensor is freed)."""
        if not (isinstance(block, dict) and "file" in block):
            return tensor_from_wire(block, what)
        name, dtype, shape = block["file"], block["dtype"], check_shape(block["shape"], what)
        if not isinstance(name, str) or Path(name).name != name or dtype not in DTYPES:
            raise WireError(f"{what}: a file block names a file in the handoff directory")
        path = self.directory / name
        self._wait(path, what)
        size = byte_size(dtype, shape)
        if path.stat().st_size != size:
            raise WireError(f"{what}: {path} holds {path.stat().st_size} bytes, not {size}")
        data = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        path.unlink()
        return data.view(DTYPES[dtype]).reshape(shape)

    def _wait(self, path: Path, what: str) -> None:
        deadline, pause = time.monotonic() + WAIT_SECONDS, 0.0005
        error = path.with_name(path.name + ERROR)
        while not path.exists():
            if error.exists():
                message = error.read_text()
                error.unlink()
                raise OSError(
                    f"{what}: the worker could not write the captured rows to {path.parent}: "
                    f"{message}; set {DIR_ENV} to a directory with room for them"
                )
            if not self.alive():
                raise OSError(f"{what}: the engine stopped before its workers wrote {path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: no rows in {path} after {WAIT_SECONDS:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _root() -> str | None:
    """`VINTERP_CAPTURE_DIR`, else /dev/shm when it has room, else the system temp dir."""
    chosen = os.environ.get(DIR_ENV)
    if chosen:
        Path(chosen).mkdir(parents=True, exist_ok=True)
        return chosen
    try:
        if shutil.disk_usage(SHARED_MEMORY).free >= MIN_FREE and os.access(SHARED_MEMORY, os.W_OK):
            return SHARED_MEMORY
    except OSError:
        pass
    return None


class FileWriter:
    """The worker's side: `block` answers with a file name and writes the file on a thread
    (after the device has computed the rows; the copy to the host runs on a stream of its
    own), so the engine's loop goes on while rows reach the front end."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._thread = threading.local()  # each writer thread's stream and staging buffer
        self.host = host_key()

    def encoder(self, request: dict[str, str] | None) -> Any:
        """How this take's blocks travel: into the front end's directory when it is on this
        host, else inline."""
        if (
            not isinstance(request, dict)
            or request.get("host") != self.host
            or not Path(str(request.get("directory"))).is_dir()
        ):
            return tensor_to_wire
        directory = Path(request["directory"])
        return lambda values: self.block(values, directory)

    def block(self, values: torch.Tensor, directory: Path) -> dict[str, Any]:
        if values.numel() * values.element_size() < INLINE_BYTES:
            return tensor_to_wire(values)
        name = f"{uuid.uuid4().hex}.rows"
        ready = None
        if values.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                WRITE_THREADS, thread_name_prefix="vinterp-capture-files"
            )
        self._pool.submit(self._write, values, ready, directory / name)
        dtype = str(values.dtype).removeprefix("torch.")
        return {"dtype": dtype, "shape": list(values.shape), "file": name}

    def _write(self, values: torch.Tensor, ready: Any, path: Path) -> None:
        """Write the rows, then give the file its name. The file's room is taken first, so a
        full disk is an error here, never a fault in a mapping. Rows in host memory go in
        with one write; rows on a device pass through this thread's pinned buffer (on a
        stream of its own, after the step that computed them), since a copy from the device
        into pageable or mapped memory is several times slower than into pinned memory."""
        part = path.with_name(path.name + PART)
        try:
            size = values.numel() * values.element_size()
            with open(part, "wb") as file:
                os.posix_fallocate(file.fileno(), 0, size)
                if ready is None:
                    file.write(
                        memoryview(values.contiguous().reshape(-1).view(torch.uint8).numpy())
                    )
                else:
                    self._write_from_device(values, ready, file)
            os.rename(part, path)
        except BaseException as exc:  # the front end waits for the file: tell it why not
            part.unlink(missing_ok=True)
            path.with_name(path.name + ERROR).write_text(f"{type(exc).__name__}: {exc}")

    def _write_from_device(self, values: torch.Tensor, ready: Any, file: Any) -> None:
        local = self._thread
        if getattr(local, "device", None) != values.device:
            local.device = values.device
            local.stream = torch.cuda.Stream(values.device)
            local.staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(local.stream):
            local.stream.wait_event(ready)
            flat = values.contiguous().reshape(-1).view(torch.uint8)
            for start in range(0, flat.numel(), STAGING_BYTES):
                piece = local.staging[: min(STAGING_BYTES, flat.numel() - start)]
                piece.copy_(flat[start : start + piece.numel()], non_blocking=True)
                local.stream.synchronize()
                file.write(memoryview(piece.numpy()))
