"""vLLM general-plugin entry point (declared in pyproject.toml as `vllm.general_plugins`).

vLLM calls `register()` in every process it starts (engine core and each worker), which is
where vinterp's worker-side pieces get installed.
"""


def register() -> None:
    """Install vinterp's worker-side pieces; importing vinterp.engine is all that is needed yet."""
    import vinterp.engine  # noqa: F401
