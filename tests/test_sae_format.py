"""vinterp.SAE against SAELens itself: SAEs saved by SAELens load in vinterp and encode, decode
and reconstruct as SAELens does on the same rows; SAEs saved by vinterp load in SAELens; the
wire form round-trips and refuses malformed input; bad input gets one clear error each."""

from __future__ import annotations

import ast
import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest
import sae_lens
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file, save_file
from safetensors.torch import save as save_safetensors

import vinterp
from vinterp.sae import format as fmt
from vinterp.wire.errors import WireError

D_IN, D_SAE = 16, 48

# (architecture, cfg fields): every normalisation SAELens accepts, b_dec applied or not.
CASES = [
    ("standard", {"normalize_activations": "none"}),
    ("standard", {"normalize_activations": "constant_norm_rescale", "apply_b_dec_to_input": False}),
    ("standard", {"normalize_activations": "layer_norm"}),
    ("standard", {"normalize_activations": "expected_average_only_in"}),
    ("standard", {"normalize_activations": "covariance_whitening", "apply_b_dec_to_input": False}),
    ("topk", {"k": 5}),
    ("topk", {"k": 5, "rescale_acts_by_decoder_norm": True, "apply_b_dec_to_input": False}),
    ("topk", {"k": 3, "normalize_activations": "layer_norm"}),
    ("jumprelu", {}),
    ("jumprelu", {"normalize_activations": "constant_norm_rescale"}),
    ("jumprelu", {"normalize_activations": "layer_norm", "apply_b_dec_to_input": False}),
]
SAELENS_CLASSES = {
    "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig),
    "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig),
    "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig),
}


def saelens_sae(architecture: str, fields: dict[str, Any], seed: int = 0) -> Any:
    """A SAELens inference SAE with random weights (nonzero biases, thresholds that let part
    of the features through, top-k rows with fewer than k positive features) and a hook name
    in its metadata."""
    cls, cfg_cls = SAELENS_CLASSES[architecture]
    sae = cls(cfg_cls(d_in=D_IN, d_sae=D_SAE, **fields))
    sae.cfg.metadata.hook_name = "layers.6.output"
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in sae.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        if architecture == "jumprelu":
            sae.threshold.copy_(torch.rand(D_SAE, generator=generator) * 0.5)
        if architecture == "topk":
            sae.b_enc.sub_(3.0)  # some rows' top k include negative pre-activations
    return sae


def save_saelens(path: Path, sae: Any) -> Path:
    sae.save_model(path)
    return path


def loaded(tmp_path: Path, architecture: str, fields: dict[str, Any]) -> vinterp.SAE:
    return vinterp.SAE.load(save_saelens(tmp_path, saelens_sae(architecture, fields)))


def rows(seed: int = 1) -> torch.Tensor:
    """(3, 5, D_IN) rows with an offset and scale unlike the unit normal the weights came from."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(3, 5, D_IN, generator=generator) * 2.0 + 0.5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def assert_same_math(ours: vinterp.SAE, theirs: Any, x: torch.Tensor) -> None:
    """encode, decode, error and top-k equal SAELens's on x (float32, rel <= 1e-5)."""
    with torch.no_grad():
        f_ref = theirs.encode(x)
        x_hat_ref = theirs.decode(f_ref)  # SAELens decodes with the statistics of that encode
        theirs.encode(x)
        error_ref = x - theirs.decode(theirs.encode(x))
    f = ours.encode(x)
    assert f.shape == (*x.shape[:-1], D_SAE) and (f > 0).any() and (f == 0).any()
    assert rel(f, f_ref) <= 1e-5
    if ours.k is not None:
        assert ((f > 0).sum(-1) < ours.k).any()  # the relu after the top k matters
    assert rel(ours.decode(f, x), x_hat_ref) <= 1e-5
    if ours.normalize_activations not in fmt.RUN_TIME_NORMALIZATIONS:
        assert torch.equal(ours.decode(f), ours.decode(f, x))
    assert rel(ours.error(x), error_ref) <= 1e-5
    indices, values = ours.topk(x, 4)
    assert indices.dtype == torch.int64 and indices.shape == values.shape == (*x.shape[:-1], 4)
    assert torch.equal(values, f_ref.topk(4, dim=-1).values)
    assert torch.equal(f_ref.gather(-1, indices), values)


@pytest.mark.parametrize(("architecture", "fields"), CASES)
def test_saelens_saved_loads_with_its_math(tmp_path, architecture, fields) -> None:
    theirs = saelens_sae(architecture, fields)
    theirs.save_model(tmp_path)
    ours = vinterp.SAE.load(tmp_path)
    assert (ours.architecture, ours.d_in, ours.d_sae) == (architecture, D_IN, D_SAE)
    assert ours.k == fields.get("k")
    assert (ours.threshold is not None) == (architecture == "jumprelu")
    assert ours.metadata["hook_name"] == "layers.6.output"
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name))
    assert_same_math(ours, theirs, rows())


@pytest.mark.parametrize(("architecture", "fields"), CASES)
def test_vinterp_saved_loads_in_saelens(tmp_path, architecture, fields) -> None:
    ours = vinterp.SAE.load(save_saelens(tmp_path / "a", saelens_sae(architecture, fields, 3)))
    ours.save(tmp_path / "b")
    theirs = sae_lens.SAE.load_from_disk(tmp_path / "b")
    assert type(theirs) is SAELENS_CLASSES[architecture][0]
    assert theirs.cfg.normalize_activations == ours.normalize_activations
    assert theirs.cfg.apply_b_dec_to_input == ours.apply_b_dec_to_input
    assert theirs.cfg.metadata.hook_name == "layers.6.output"
    assert_same_math(ours, theirs, rows(4))
    assert vinterp.SAE.load(tmp_path / "b").digest == ours.digest


def test_the_training_example_saves_a_loadable_sae(tmp_path) -> None:
    """examples/sae_training.py saves a StandardTrainingSAE with SAELens's `save_model`: its
    training-only cfg fields are ignored, its math is the inference SAE's."""
    torch.manual_seed(0)
    trained = sae_lens.StandardTrainingSAE(
        sae_lens.StandardTrainingSAEConfig(d_in=D_IN, d_sae=D_SAE, l1_coefficient=2.0)
    )
    with torch.no_grad():
        trained.b_enc.normal_()
        trained.b_dec.normal_()
    trained.save_model(tmp_path)
    assert "l1_coefficient" in json.loads((tmp_path / fmt.CFG_FILENAME).read_text())
    assert_same_math(vinterp.SAE.load(tmp_path), trained, rows())


def test_pre_6_cfg_is_read_as_saelens_reads_it(tmp_path) -> None:
    """A SAELens 5.x top-k cfg (no version, k in activation_fn_kwargs, normalisation as a
    bool) and a unit scaling_factor beside the weights."""
    theirs = saelens_sae("topk", {"k": 4})
    theirs.save_model(tmp_path)
    tensors = load_file(tmp_path / fmt.WEIGHTS_FILENAME)
    save_file({**tensors, "scaling_factor": torch.ones(D_SAE)}, tmp_path / fmt.WEIGHTS_FILENAME)
    old = {
        "d_in": D_IN,
        "d_sae": D_SAE,
        "dtype": "float32",
        "device": "cpu",
        "hook_point": "blocks.6.hook_resid_post",
        "activation_fn_str": "topk",
        "activation_fn_kwargs": {"k": 4},
        "normalize_activations": False,
    }
    (tmp_path / fmt.CFG_FILENAME).write_text(json.dumps(old))
    ours = vinterp.SAE.load(tmp_path)
    assert (ours.architecture, ours.k, ours.apply_b_dec_to_input) == ("topk", 4, True)
    assert ours.metadata == {"hook_name": "blocks.6.hook_resid_post"}
    assert_same_math(ours, sae_lens.SAE.load_from_disk(tmp_path), rows())


def test_cfg_dtype_is_the_weights_dtype(tmp_path) -> None:
    theirs = saelens_sae("jumprelu", {}).to(dtype=torch.bfloat16)
    theirs.save_model(tmp_path)
    ours = vinterp.SAE.load(tmp_path)
    assert ours.dtype == ours.threshold.dtype == torch.bfloat16
    x = rows().bfloat16()
    assert torch.equal(ours.encode(x), theirs.encode(x))
    wide = ours.to(dtype=torch.float32)
    assert wide.dtype == torch.float32 and ours.dtype == torch.bfloat16  # a copy
    assert wide.encode(x).dtype == torch.float32
    assert wide.digest != ours.digest
    assert json.loads((tmp_path / fmt.CFG_FILENAME).read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize(("architecture", "fields"), [CASES[1], CASES[6], CASES[10]])
def test_wire_round_trip(tmp_path, architecture, fields) -> None:
    ours = loaded(tmp_path, architecture, fields)
    wire = json.loads(json.dumps(ours.to_wire()))  # JSON-safe
    back = vinterp.SAE.from_wire(wire)
    assert back.digest == ours.digest == wire["digest"]
    assert back.cfg() == ours.cfg()
    assert (back.threshold is None) == (ours.threshold is None)
    for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold"):
        if getattr(ours, name) is not None:
            assert torch.equal(getattr(back, name), getattr(ours, name))
    x = rows()
    assert torch.equal(back.encode(x), ours.encode(x))


def with_tensors(wire: dict[str, Any], **changes: torch.Tensor | None) -> dict[str, Any]:
    """`wire` with some tensors replaced (None: removed), its digest kept."""
    tensors = load_safetensors(base64.b64decode(wire["weights"]))
    tensors = {k: v for k, v in {**tensors, **changes}.items() if v is not None}
    return {**wire, "weights": base64.b64encode(save_safetensors(tensors)).decode()}


def with_cfg(wire: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**wire, "cfg": {**wire["cfg"], **changes}}


BAD_WIRES = [
    (lambda w: [w], "a JSON object with keys cfg, weights, digest"),
    (lambda w: {k: v for k, v in w.items() if k != "digest"}, "keys cfg, weights, digest"),
    (lambda w: {**w, "weights": "not base64!"}, "not a base64 safetensors file"),
    (lambda w: {**w, "weights": base64.b64encode(b"x" * 64).decode()}, "not a base64 safetensors"),
    (lambda w: {**w, "cfg": "standard"}, "an SAE cfg is a JSON object"),
    (lambda w: with_cfg(w, architecture="gated"), "unknown SAE architecture 'gated'"),
    (lambda w: with_cfg(w, d_in="16"), "d_in must be a positive integer, not '16'"),
    (
        lambda w: with_cfg(w, d_sae=D_SAE + 1),
        "the cfg says d_in 16, d_sae 49 but W_enc is (16, 48)",
    ),
    (lambda w: with_cfg(w, dtype="int8"), "dtype 'int8' is not one of"),
    (lambda w: with_cfg(w, apply_b_dec_to_input=1), "apply_b_dec_to_input must be true or false"),
    (lambda w: with_tensors(w, W_dec=torch.zeros(D_IN, D_SAE)), "W_dec must be (48, 16)"),
    (lambda w: with_tensors(w, W_enc=torch.zeros(D_IN)), "W_enc must be (d_in, d_sae), not (16,)"),
    (lambda w: with_tensors(w, b_enc=torch.zeros(D_SAE, dtype=torch.int32)), "not floating"),
    (lambda w: with_tensors(w, threshold=None), "missing: threshold"),
    (lambda w: with_tensors(w, b_gate=torch.zeros(D_SAE)), "unexpected: 'b_gate'"),
    (lambda w: with_tensors(w, b_dec=torch.ones(D_IN)), "do not match the digest"),
]


@pytest.mark.parametrize(("corrupt", "message"), BAD_WIRES)
def test_bad_wire_is_refused(tmp_path, corrupt, message) -> None:
    wire = loaded(tmp_path, "jumprelu", {}).to_wire()
    with pytest.raises(WireError, match=re.escape(message)):
        vinterp.SAE.from_wire(corrupt(wire))


def test_bad_topk_k_on_the_wire(tmp_path) -> None:
    wire = loaded(tmp_path, "topk", {"k": 5}).to_wire()
    with pytest.raises(WireError, match="a topk SAE needs k in 1..48, not 49"):
        vinterp.SAE.from_wire(with_cfg(wire, k=D_SAE + 1))


def test_unknown_architecture_names_it_and_the_supported_ones(tmp_path) -> None:
    sae_lens.GatedSAE(sae_lens.GatedSAEConfig(d_in=D_IN, d_sae=D_SAE)).save_model(tmp_path)
    message = "unknown SAE architecture 'gated'; vinterp supports standard, topk, jumprelu"
    with pytest.raises(ValueError, match=re.escape(message)):
        vinterp.SAE.load(tmp_path)


def test_unsupported_saelens_settings_are_refused(tmp_path) -> None:
    save_saelens(tmp_path, saelens_sae("standard", {}))
    tensors = load_file(tmp_path / fmt.WEIGHTS_FILENAME)
    doubled = {**tensors, "scaling_factor": torch.full((D_SAE,), 2.0)}
    save_file(doubled, tmp_path / fmt.WEIGHTS_FILENAME)
    with pytest.raises(ValueError, match="non-unit scaling_factor"):
        vinterp.SAE.load(tmp_path)
    save_file(tensors, tmp_path / fmt.WEIGHTS_FILENAME)
    cfg = json.loads((tmp_path / fmt.CFG_FILENAME).read_text())
    (tmp_path / fmt.CFG_FILENAME).write_text(json.dumps({**cfg, "reshape_activations": "hook_z"}))
    with pytest.raises(ValueError, match="reshape_activations 'hook_z' is not supported"):
        vinterp.SAE.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="needs cfg.json and sae_weights.safetensors"):
        vinterp.SAE.load(tmp_path / "missing")


def test_feature_and_width_checks(tmp_path) -> None:
    sae = loaded(tmp_path, "standard", {"normalize_activations": "layer_norm"})
    assert sae.check_feature(D_SAE - 1) == D_SAE - 1
    for index in (70000, D_SAE, -1):
        message = f"feature {index} is out of range; this SAE has 48 features (0..47)"
        with pytest.raises(ValueError, match=re.escape(message)):
            sae.check_feature(index)
    with pytest.raises(ValueError, match="a feature index is an integer, not '3'"):
        sae.check_feature("3")
    sae.check_width(D_IN, "layers.10.output")
    message = "the SAE's d_in 16 differs from the hidden size 576 of layers.10.output"
    with pytest.raises(ValueError, match=re.escape(message)):
        sae.check_width(576, "layers.10.output")
    with pytest.raises(ValueError, match=re.escape("x (2, 17) does not end in this SAE's d_in 16")):
        sae.encode(torch.zeros(2, D_IN + 1))
    with pytest.raises(
        ValueError, match=re.escape("f (2, 16) does not end in this SAE's d_sae 48")
    ):
        sae.decode(torch.zeros(2, D_IN), torch.zeros(2, D_IN))
    with pytest.raises(ValueError, match="decode\\(f, x\\) needs the rows x"):
        sae.decode(sae.encode(rows()))
    with pytest.raises(ValueError, match="k must be in 1..48"):
        sae.topk(rows(), D_SAE + 1)


def test_the_package_imports_neither_saelens_nor_vllm() -> None:
    """vinterp.SAE reimplements SAELens's format and math: no SAELens or vLLM at run time."""
    for path in Path(fmt.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            assert not {m.split(".")[0] for m in modules} & {"sae_lens", "vllm"}, path


def test_the_digest_follows_every_change_of_the_weights() -> None:
    """The digest is hashed once and kept: a weight changed in place or replaced (even by an
    equal copy: its bytes are hashed again) gives the digest of the new weights."""
    from vinterp.bench.bench_sae import random_sae

    sae = random_sae(64)
    first = sae.digest
    assert sae.digest == first == random_sae(64).digest
    sae.W_enc[0, 0] += 1.0  # in place
    changed = sae.digest
    assert (
        changed != first
        and changed
        == vinterp.SAE(
            **{
                name: getattr(sae, name)
                for name in ("architecture", "W_enc", "b_enc", "W_dec", "b_dec")
            }
        ).digest
    )
    sae.W_enc = random_sae(64).W_enc  # replaced
    assert sae.digest == first
