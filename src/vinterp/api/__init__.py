"""What users import: the LLM and, later, trace contexts, steering and capture specs."""

from vinterp.api.llm import LLM

__all__ = ["LLM"]
