"""Never silent: an intervention the engine did not apply is an error, not a wrong result.

The engine runs in the script's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0, eager), so the
script can take one layer's sites out of the loaded model: the failure of a runner whose
model has no sites, or of a replayed graph that skips them. Steering, capture and a trace at
that layer must then raise, naming the site; steering elsewhere still works, and the engine
keeps serving. With the workers' check off, the front end still refuses a capture whose rows
did not come back. An `AsyncLLM.stream` at that layer raises after its last chunk.
"""

from __future__ import annotations

import json
import textwrap

import pytest

pytestmark = pytest.mark.engine("tiny_applied_check")

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys, torch, vinterp

    def drop_layer_1_sites(worker):
        layer = worker.model_runner.get_model().model.layers[1]
        layer.__class__ = layer._vinterp_base

    async def streamed(path, prompt, v):
        # the engine core is its own process: the RPC sends the function (cloudpickle)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        allm = vinterp.AsyncLLM(path, enforce_eager=True, check_applied=True)
        chunks = []
        try:
            engine = allm.backend
            await engine._on_loop(engine.llm.collective_rpc(drop_layer_1_sites))
            steering = vinterp.Steering({"layers.1.output": v}, scale=8.0)
            async for out in allm.stream(prompt, steering=steering, max_tokens=3):
                chunks.append(out.token_ids)
            return {"chunks": chunks}
        except vinterp.InterventionError as exc:
            return {"chunks": chunks, "error": str(exc)}
        finally:
            allm.shutdown()

    def outcome(fn):
        try:
            return {"tokens": fn()}
        except vinterp.InterventionError as exc:
            return {"error": str(exc)}

    if __name__ == "__main__":
        llm = vinterp.LLM(sys.argv[1], enforce_eager=True, check_applied=True)
        prompts = ["The capital of France is", "Once upon a time"]
        v = torch.randn(256, generator=torch.Generator().manual_seed(3))

        def generate(**kwargs):
            return [o.token_ids for o in llm.generate(prompts, max_tokens=3, **kwargs)]

        def traced():
            with llm.trace(prompts[0], max_tokens=2) as tr:
                llm.layers[1].output[-1] = llm.layers[1].output[-1] * 0
            return tr.outputs[0].token_ids

        results = {"plain": outcome(generate), "layer0_before": outcome(
            lambda: generate(steering=vinterp.Steering({"layers.0.output": v}, scale=8.0)))}
        llm.engine.collective_rpc(drop_layer_1_sites)
        results["steer"] = outcome(
            lambda: generate(steering=vinterp.Steering({"layers.1.output": v}, scale=8.0)))
        results["capture"] = outcome(lambda: generate(capture=vinterp.Capture("layers.1.output")))
        results["trace"] = outcome(traced)
        results["layer0"] = outcome(
            lambda: generate(steering=vinterp.Steering({"layers.0.output": v}, scale=8.0)))
        results["plain_after"] = outcome(generate)
        llm.backend.check_applied = False  # only the front end's own check is left
        results["capture_unchecked"] = outcome(
            lambda: generate(capture=vinterp.Capture("layers.1.output", positions="all")))
        llm.shutdown()
        results["stream"] = asyncio.run(streamed(sys.argv[1], prompts[0], v))
        print("RESULTS", json.dumps(results), flush=True)
    """
)


def test_interventions_that_were_not_applied_raise(engine_script, tiny_llama) -> None:
    lines = engine_script(SCRIPT, str(tiny_llama), expect="RESULTS")
    results = json.loads(lines["RESULTS"])
    plain = results["plain"]["tokens"]
    steered_layer0 = results["layer0_before"]["tokens"]
    assert steered_layer0 != plain  # the steering vector is strong enough to show
    # steering: 2 prompts of 6 and 5 tokens, then 2 decoding steps of 2 tokens
    error = results["steer"]["error"]
    assert "steering at layers.1.output reached 0 of the" in error, error
    assert (
        "Python handlers did not run at layers.1.input, layers.1.output"
        in (results["capture"]["error"])
    )
    assert "layers.1.output" in results["trace"]["error"]
    assert results["layer0"]["tokens"] == steered_layer0  # the other sites still apply
    assert results["plain_after"]["tokens"] == plain  # the engine kept serving, unchanged
    error = results["capture_unchecked"]["error"]
    assert "capture of layers.1.output (positions='all'): 0 of the" in error, error
    # AsyncLLM.stream: every chunk arrives, then the check after the last one raises
    stream = results["stream"]
    assert len(stream["chunks"]) >= 1 and len(stream["chunks"][-1]) == 3
    assert "steering at layers.1.output reached 0 of the" in stream["error"], stream
