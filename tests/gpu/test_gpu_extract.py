"""`llm.extract` on a GPU in bf16 (how to run: tests/gpu/conftest.py): the rows of an engine
with vLLM's defaults (capturing steps uncompiled) equal an `enforce_eager` engine's bit for
bit and its own trace saves of the same tokens; the extraction engine (`vinterp extract`'s:
capture buffers of a step's tokens at the sites) keeps every capturing step compiled and
stays within the compiled-vs-eager bf16 distance of the eager rows.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from vinterp.extraction.request import engine_settings
from vinterp.sites.names import SiteOrder
from vinterp.store import site_tensor

pytestmark = [
    pytest.mark.engine("gpu_extract"),
    pytest.mark.gpus(1),
]

MODEL_ENV, DEFAULT_MODEL = "VINTERP_GPU_MODEL", "bundled"
MAX_MODEL_LEN = 2048
ALL = ("all_prompt", ["layers.5.output", "layers.20.output"])
LAST = ("last_prompt", ["layers.*.output"])
# as test_gpu_check's IN_GRAPH_REL_TOL: values computed inside the compiled graphs
IN_GRAPH_REL_TOL = 1e-1
ENGINES = {"graphs": {}, "eager": {"enforce_eager": True}, "extraction": None}


def extracted(llm: Any, gpu: Any) -> dict[str, Any]:
    """Per spec (positions), per site: the stored rows; the step counts of the last spec's
    run; trace saves of layers.5.output per prompt."""
    rows: dict[str, dict[str, torch.Tensor]] = {}
    stats = {}
    for positions, sites in (ALL, LAST):
        with tempfile.TemporaryDirectory() as out:
            before = llm.step_stats()
            llm.extract(gpu.PROMPTS, sites, positions=positions, out=out, use_tqdm=False)
            after = llm.step_stats()
            stats[positions] = {k: after[k] - before[k] for k in before}
            names = [name for p in sites for name in SiteOrder(len(llm.layers)).expand(p)]
            rows[positions] = {s: site_tensor(out, s).clone() for s in names}
    saves = []
    for prompt in gpu.PROMPTS:
        with llm.trace(prompt, max_tokens=1):
            h = llm.layers[5].output.save()
        saves.append(h.float().cpu())
    return {"rows": rows, "stats": stats, "saves": saves}


@pytest.fixture(scope="module")
def results(gpu, report):
    done: dict[str, dict[str, Any]] = {}

    def get(engine: str) -> dict[str, Any]:
        if engine not in done:
            settings = ENGINES[engine]
            if settings is None:
                settings = engine_settings([s for _, sites in (ALL, LAST) for s in sites])
            kwargs = {"max_model_len": MAX_MODEL_LEN, **settings}

            def run() -> dict[str, Any]:
                return gpu.vinterp_engine(report.model, lambda llm: extracted(llm, gpu), **kwargs)

            done[engine] = report.kept(f"extract-{engine}", run)
            report.data.setdefault("stats", {})[engine] = done[engine]["stats"]
        return done[engine]

    return get


@pytest.mark.parametrize("positions", ("all_prompt", "last_prompt"))
def test_rows_equal_the_eager_engines(results, report, positions) -> None:
    got, want = results("graphs")["rows"][positions], results("eager")["rows"][positions]
    differing = [s for s in want if not torch.equal(got[s], want[s])]
    numbers = f"{len(want) - len(differing)}/{len(want)} sites equal"
    check = f"extract {positions} = enforce_eager (bit for bit)"
    assert report.check(check, numbers, not differing)


def test_rows_equal_the_engines_own_trace_saves(results, report, gpu) -> None:
    done = results("graphs")
    rows = done["rows"]["all_prompt"]["layers.5.output"].float()
    saves = torch.cat(done["saves"])
    ok = rows.shape == saves.shape and torch.equal(rows, saves)
    assert report.check("extract all_prompt = trace saves (bit for bit)", str(rows.shape), ok)


@pytest.mark.parametrize("positions", ("all_prompt", "last_prompt"))
def test_the_extraction_engine_stays_compiled(results, report, gpu, positions) -> None:
    done = results("extraction")
    stats = done["stats"][positions]
    compiled = stats["uncompiled_steps"] == 0 and stats["graph_capture_steps"] > 0
    want = results("eager")["rows"][positions]
    worst = max(gpu.rel_err(done["rows"][positions][s], want[s]) for s in want)
    numbers = f"uncompiled {stats['uncompiled_steps']}, rel {worst:.1e}"
    ok = compiled and worst <= IN_GRAPH_REL_TOL
    assert report.check(f"extraction engine {positions}: compiled, rows ~ eager", numbers, ok)
