"""Engine settings for tests whose subject is not the compiler: vLLM traces the model whole
with Dynamo, site ops included, as every engine does, and runs the traced graph op by op
rather than through Inductor, whose code generation and C++ compile are most of an engine
start on two cores. What such a test checks (values, tokens, which steps ran compiled, what
crosses processes) holds for the traced graph as for Inductor's; Inductor with the site ops
is tested on the bundled model's engine and on the tiny llama's of the modules about
kernels, compiled steps and the compile cache."""

from __future__ import annotations

from vllm.config import CompilationMode

TRACED_NOT_INDUCTOR = {
    "compilation_config": {"mode": CompilationMode.DYNAMO_TRACE_ONCE, "backend": "eager"}
}
