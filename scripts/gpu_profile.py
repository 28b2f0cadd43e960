"""Interleaved timing of idle, steering and capture on one vinterp engine, and cProfile of
(engine core in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
import cProfile, io, os, pstats, sys, time
import torch
import vinterp

N, T = int(os.environ.get("N", 256)), int(os.environ.get("T", 128))
texts = [f"Write a short story about a robot number {i} who learns to paint." for i in range(N)]
llm = vinterp.LLM(vinterp.models.bundled(), dtype="bfloat16", max_model_len=2048)
print("engine up", flush=True)
v = torch.randn(llm.config.hidden_size, generator=torch.Generator().manual_seed(0))
site = "layers.10.output"
W = {
    "idle": {},
    "steer": {"steering": vinterp.Steering({site: v}, scale=4.0)},
    "cap1": {"capture": vinterp.Capture(site)},
    "caplast": {"capture": vinterp.Capture("layers.*.output", positions="last_prompt")},
}
def gen(kw):
    return llm.generate(texts, max_tokens=T, ignore_eos=True, use_tqdm=False, **kw)
for k, kw in W.items():
    gen(kw)
times = {k: [] for k in W}
for rep in range(int(os.environ.get("REPS", 5))):
    for k, kw in W.items():
        s0 = llm.step_stats(); t = time.perf_counter(); gen(kw); dt = time.perf_counter() - t
        s1 = llm.step_stats(); times[k].append(dt)
        if rep == 0:
            print(k, "steps", s1["steps"] - s0["steps"], "uncompiled", s1["uncompiled_steps"] - s0["uncompiled_steps"], flush=True)
for k, ts in times.items():
    ts2 = sorted(ts)
    print(f"{k:8s} min {ts2[0]:.3f} med {ts2[len(ts2)//2]:.3f} all {[round(x,3) for x in ts]} ratio_med_to_idle {ts2[len(ts2)//2]/sorted(times['idle'])[len(ts)//2]:.3f}", flush=True)
if os.environ.get("PROF"):
    for k in os.environ["PROF"].split(","):
        pr = cProfile.Profile(); pr.enable(); gen(W[k]); pr.disable()
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        print("==== profile", k); print(s.getvalue()[:6000], flush=True)
llm.shutdown()
