"""Finding site modules in a module tree: defaults, overrides, clear failures."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

import vinterp
from vinterp.sites.modules import find_site_modules
from vinterp.sites.names import UnknownSiteError


@pytest.fixture
def renamed(tiny_llama):
    """A Llama whose layer container is `model.blocks` and whose MLPs are `ffn`."""
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_llama))
    model.model.blocks = model.model.layers
    del model.model.layers
    for layer in model.model.blocks:
        layer.ffn = layer.mlp
        del layer.mlp
    return model


def test_renamed_container_fails_clearly_without_override(renamed) -> None:
    with pytest.raises(UnknownSiteError, match="cannot find layers at 'model.layers'"):
        find_site_modules(renamed, "llama")
    with pytest.raises(UnknownSiteError, match=r"mlp_input at model.blocks\[i\].mlp"):
        find_site_modules(renamed, "llama", {"layers": "model.blocks"})


def test_renamed_container_works_with_override(renamed) -> None:
    modules = find_site_modules(renamed, "llama", {"layers": "model.blocks", "mlp": "ffn"})
    assert modules.layers is renamed.model.blocks
    assert modules.mlp_input(modules.layers[2]) is renamed.model.blocks[2].ffn
    assert modules.mlp_output(modules.layers[2]) is renamed.model.blocks[2].ffn
    assert modules.attn(modules.layers[0]) is renamed.model.blocks[0].self_attn


def test_unsupported_model_type_is_refused_before_loading() -> None:
    with pytest.raises(UnknownSiteError, match="model type .bloom. has no site map"):
        vinterp.sites.modules.check_site_paths("bloom", None)
    with pytest.raises(UnknownSiteError, match="unknown keys"):
        vinterp.sites.modules.check_site_paths("llama", {"blocks": "model.layers"})


def test_wrong_override_names_the_path(tiny_llama) -> None:
    with pytest.raises(UnknownSiteError, match="cannot find layers at 'model.nope'"):
        vinterp.LLM(tiny_llama, backend="hf", sites={"layers": "model.nope"})
