"""A second CPU engine of the same configuration loads the model vLLM compiled and saved at the
first start, instead of compiling it again, and the loaded model keeps its sites.

vLLM 0.32's CPU loader fails on its own saved artifact (`engine/cpu_compile_cache.py`), which
made every engine start compile from nothing. The engines run in the script's own process
(one worker), so the script can read vLLM's compilation counters.
"""

from __future__ import annotations

import json
import textwrap

import pytest

pytestmark = pytest.mark.engine("tiny_compile_cache")

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, vinterp
    from vllm.compilation.counter import compilation_counter

    def run(path):
        llm = vinterp.LLM(path)
        v = torch.randn(256, generator=torch.Generator().manual_seed(3))
        steering = vinterp.Steering({"layers.1.output": v}, scale=8.0)
        plain = llm.generate(["Once upon a time"], max_tokens=8, ignore_eos=True)
        steered = llm.generate(["Once upon a time"], max_tokens=8, ignore_eos=True,
                               steering=steering)
        llm.shutdown()
        return [plain[0].token_ids, steered[0].token_ids]

    if __name__ == "__main__":
        first = run(sys.argv[1])
        loaded_before = compilation_counter.num_aot_artifacts_loaded
        second = run(sys.argv[1])
        print("TOKENS", json.dumps([first, second]), flush=True)
        print("LOADED", compilation_counter.num_aot_artifacts_loaded - loaded_before, flush=True)
    """
)


def test_second_engine_start_loads_the_saved_compiled_model(engine_script, tiny_llama) -> None:
    lines = engine_script(SCRIPT, str(tiny_llama), expect="LOADED")
    assert int(lines["LOADED"]) == 1
    first, second = json.loads(lines["TOKENS"])
    assert second == first  # the loaded model computes what the compiled one did
    assert first[1] != first[0]  # and its steering site works
