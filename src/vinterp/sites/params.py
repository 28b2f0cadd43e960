"""Parameter names a trace may read (`llm.lm_head.weight`, `llm.layers[i].mlp.up_proj.weight`).

Names follow the HF module tree so a value read on vLLM (merged qkv / gate_up, sharded under
tensor parallelism) is the same tensor as the checkpoint's. Read-only: a trace computes with
them but never writes them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from vinterp.sites.names import UnknownSiteError

PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
_PARAM_RE = re.compile(r"^(?:(embed|lm_head)|layers\.(\d+)\.(self_attn|mlp)\.(\w+))\.weight$")


@dataclass(frozen=True)
class ParamName:
    """`embed`/`lm_head` (layer None), or a projection `block.proj` of a decoder layer."""

    module: str  # "embed", "lm_head", or e.g. "self_attn.q_proj" within layer `layer`
    layer: int | None = None

    @property
    def projection(self) -> str:
        return self.module.rsplit(".", 1)[-1]


def parse_param(name: str, num_layers: int) -> ParamName:
    """The parameter a wire name refers to, or UnknownSiteError saying what would be right."""
    match = _PARAM_RE.match(name)
    if match is None:
        raise UnknownSiteError(
            f"unknown parameter {name!r}; a trace can read embed.weight, lm_head.weight and "
            "layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.mlp.{gate,up,down}_proj.weight"
        )
    if match.group(1):
        return ParamName(match.group(1))
    layer, block, proj = int(match.group(2)), match.group(3), match.group(4)
    if layer >= num_layers:
        raise UnknownSiteError(
            f"parameter {name!r}: layer index {layer} is out of range; "
            f"this model has layers 0..{num_layers - 1}"
        )
    if proj not in PROJECTIONS[block]:
        raise UnknownSiteError(
            f"parameter {name!r}: {block} has the projections {', '.join(PROJECTIONS[block])}"
        )
    return ParamName(f"{block}.{proj}", layer)


def is_param_prefix(path: str) -> bool:
    """Whether `path` (e.g. `layers.0.self_attn`, `layers.0.mlp.up_proj`) leads to a parameter."""
    parts = path.split(".")
    if parts[0] in ("embed", "lm_head"):
        return len(parts) == 1
    if len(parts) >= 3 and parts[0] == "layers" and parts[2] in PROJECTIONS:
        return len(parts) == 3 or (len(parts) == 4 and parts[3] in PROJECTIONS[parts[2]])
    return False


def param_shape(config: Any, name: str) -> tuple[int, int]:
    """The HF shape of a parameter, from the model's config (for shape checks while tracing)."""
    param = parse_param(name, int(config.num_hidden_layers))
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads) * head_dim
    inner = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    rows = {
        "embed": int(config.vocab_size),
        "lm_head": int(config.vocab_size),
        "q_proj": heads * head_dim,
        "k_proj": kv,
        "v_proj": kv,
        "o_proj": hidden,
        "gate_proj": inner,
        "up_proj": inner,
        "down_proj": hidden,
    }[param.projection]
    cols = {"o_proj": heads * head_dim, "down_proj": inner}.get(param.projection, hidden)
    return rows, cols


def hf_param(sites: Any, name: str) -> torch.Tensor:
    """A parameter of the HF reference model (`sites`: its SiteModules)."""
    param = parse_param(name, len(sites.layers))
    if param.layer is None:
        module = sites.embed if param.module == "embed" else sites.lm_head
    else:
        try:
            module = sites.layers[param.layer].get_submodule(param.module)
        except AttributeError:
            raise UnknownSiteError(
                f"parameter {name!r}: this model has no module {param.module!r} in its layers "
                "(read it with llm.raw on the engine's own module names)"
            ) from None
    return module.weight.detach()
