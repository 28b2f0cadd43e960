"""Probes of `scripts/profile_bulk.py` inside vLLM's engine-core process (loaded there because
profile_bulk.py puts this folder on PYTHONPATH and sets VINTERP_PROFILE_DIR; nothing happens
without that variable).

Per forward step of the model runner: host wall time of `execute_model`, the step's tokens,
device events at its start and end (device busy in the step, device idle before it), and the
host time spent in vinterp's hooks (on_schedule, begin_step, end_step). Per engine-core loop:
the time it sat idle with no request to run (the feed was late). Per worker file write: bytes
and seconds (device copy and /dev/shm write). Per take: seconds in the worker's RPC.

Records go to VINTERP_PROFILE_DIR/core-<pid>.jsonl, flushed by a thread once a second (a
step's device times once its end event has completed), so a killed engine loses at most a
second of them."""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time

OUT = os.environ.get("VINTERP_PROFILE_DIR")


def _wrap_method(owner, name, make):
    original = getattr(owner, name)
    wrapped = make(original)
    wrapped.__name__ = getattr(original, "__name__", name)
    setattr(owner, name, wrapped)


class _Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.lines: list[dict] = []
        self.steps: list[dict] = []  # waiting for their end event
        self.last_end = None  # the previous step's end event
        threading.Thread(target=self._flush_loop, daemon=True, name="profile-flush").start()

    def add(self, record: dict) -> None:
        with self.lock:
            self.lines.append(record)

    def step(self, record: dict) -> None:
        with self.lock:
            self.steps.append(record)

    def _flush_loop(self) -> None:
        while True:
            time.sleep(1.0)
            try:
                self.flush()
            except Exception as exc:  # a probe must never take the engine down
                self.add({"kind": "probe_error", "error": repr(exc)})

    def flush(self) -> None:
        with self.lock:
            done = []
            while self.steps and self.steps[0]["_end"].query():
                done.append(self.steps.pop(0))
            lines, self.lines = self.lines, []
        for record in done:
            start, end, before = record.pop("_start"), record.pop("_end"), record.pop("_prev")
            record["gpu_ms"] = start.elapsed_time(end)
            record["gpu_idle_before_ms"] = (
                before.elapsed_time(start) if before is not None else None
            )
            lines.append(record)
        if lines:
            with open(self.path, "a") as file:
                for line in lines:
                    file.write(json.dumps(line) + "\n")


_recorder: _Recorder | None = None


def _rec() -> _Recorder:
    global _recorder
    if _recorder is None:
        _recorder = _Recorder(os.path.join(OUT, f"core-{os.getpid()}.jsonl"))
    return _recorder


def _timed_hook(holder: dict, key: str, original):
    def run(*args, **kwargs):
        began = time.perf_counter_ns()
        try:
            return original(*args, **kwargs)
        finally:
            holder[key] = holder.get(key, 0) + time.perf_counter_ns() - began

    return run


def _patch_runner_hooks(module) -> None:
    import torch

    instrument = module.instrument

    def probed_instrument(runner, runtime, calls):
        instrument(runner, runtime, calls)
        hooks: dict = {}
        for name in ("on_schedule", "begin_step", "end_step"):
            setattr(runtime, name, _timed_hook(hooks, name, getattr(runtime, name)))
        execute = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            if kwargs.get("dummy_run", False):
                return execute(scheduler_output, *args, **kwargs)
            recorder = _rec()
            hooks.clear()
            events = None
            if torch.cuda.is_available():
                events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                events[0].record()
            began = time.perf_counter()
            output = execute(scheduler_output, *args, **kwargs)
            ended = time.perf_counter()
            record = {
                "kind": "step",
                "t": began,
                "t_end": ended,
                "host_ms": (ended - began) * 1e3,
                "tokens": int(getattr(scheduler_output, "total_num_scheduled_tokens", 0)),
                "uncompiled": bool(runtime.mode.uncompiled),
                "hooks_ms": {k: v / 1e6 for k, v in hooks.items()},
            }
            if events is None:  # no device to time: the host's times only
                recorder.add(record)
                return output
            events[1].record()
            recorder.step(
                {**record, "_start": events[0], "_end": events[1], "_prev": recorder.last_end}
            )
            recorder.last_end = events[1]
            return output

        runner.execute_model = execute_model

    module.instrument = probed_instrument


def _patch_engine_core(module) -> None:
    def process_input_queue(original):
        def run(self):
            idle = not self.has_work()
            began = time.perf_counter()
            result = original(self)
            if idle:
                _rec().add({"kind": "idle", "t": began, "s": time.perf_counter() - began})
            return result

        return run

    _wrap_method(module.EngineCoreProc, "_process_input_queue", process_input_queue)


def _patch_capture_files(module) -> None:
    def write(original):
        def run(self, values, ready, path):
            began = time.perf_counter()
            original(self, values, ready, path)
            size = values.numel() * values.element_size()
            _rec().add(
                {
                    "kind": "file_write",
                    "t": began,
                    "s": time.perf_counter() - began,
                    "bytes": size,
                    "device": bool(ready is not None),
                }
            )

        return run

    _wrap_method(module.FileWriter, "_write", write)


def _patch_worker_ext(module) -> None:
    def take(original):
        def run(self, *args, **kwargs):
            began = time.perf_counter()
            result = original(self, *args, **kwargs)
            _rec().add({"kind": "take_rpc", "t": began, "s": time.perf_counter() - began})
            return result

        return run

    _wrap_method(module.VinterpWorkerExtension, "vinterp_take_captures", take)


PATCHES = {
    "vinterp.engine.vllm_boundary.runner_hooks": _patch_runner_hooks,
    "vllm.v1.engine.core": _patch_engine_core,
    "vinterp.interventions.capture_files": _patch_capture_files,
    "vinterp.engine.worker_ext": _patch_worker_ext,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs PATCHES[name] on a module right after its first import."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, patch = spec.loader, PATCHES[name]

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                try:
                    patch(module)
                except Exception as exc:
                    print(f"profile probe: could not patch {name}: {exc!r}", file=sys.stderr)

        spec.loader = Loader()
        return spec


if OUT:
    os.makedirs(OUT, exist_ok=True)
    sys.meta_path.insert(0, _PatchAfterImport())
