"""Peers of vinterp on two workloads (batch activation extraction, steered generation).

Each tool runs in a subprocess (`python -m peers.worker`, with `src/vinterp/bench` on the
path), often from its own virtual environment (`envs`), so the modules a peer's process
imports (`protocol`, `timing`, `batching`, `worker` and the tool's own module) must not
import vinterp; the bench's side (`registry`, `envs`, `runner`, `suite`) may. `check`
compares each output with vinterp's; `row` is one line of the report.
"""
