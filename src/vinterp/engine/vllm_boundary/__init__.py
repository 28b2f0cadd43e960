"""The one place vinterp meets vLLM's internals: every patch, hook, private name and internal
field it relies on lives in this package, declared with the releases it was verified on
(`targets.TARGETS`) and checked before a vinterp engine starts (`targets.check_boundary`).
The rest of engine/ uses vLLM's public API (`vllm.LLM`, `SamplingParams`, its server); no
package outside engine/ imports vLLM."""
