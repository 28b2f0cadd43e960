"""Standardized site names and where they live in HF and vLLM module trees."""
