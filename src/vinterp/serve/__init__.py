"""`vinterp serve`: vLLM's own OpenAI-compatible server with vinterp's request fields."""
