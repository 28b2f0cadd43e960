"""`vinterp bench`: workloads timed against plain vLLM on the same engine, in the same run."""
