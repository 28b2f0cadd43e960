"""SAE sites in an activation dataset, without an engine: which are refused and why, the
top-k column pair (int32 indices and values in the stored dtype) written from captured rows
and read back through `datasets` and `site_tensor`, and a spec that tells SAEs and k apart."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
import torch

import vinterp
from vinterp import cli
from vinterp.bench.bench_sae import random_sae
from vinterp.engine.engine_limits import EngineLimits
from vinterp.engine.outputs import Output
from vinterp.extraction.plan import PlannedPrompt
from vinterp.extraction.prompts import prompt_source
from vinterp.extraction.request import engine_settings, expand_sites, store_columns
from vinterp.extraction.sae import SaeFacts, check_sae_sites, load_saes
from vinterp.extraction.spec import EngineFacts, dataset_about, extraction_spec
from vinterp.extraction.stream import shard_columns
from vinterp.models.tiny import tiny_config
from vinterp.sae import SAE
from vinterp.store import ActivationStore, ShardSizes, site_tensor
from vinterp.wire.specs import Capture

CONFIG = SimpleNamespace(**tiny_config("llama"))  # 4 layers, hidden 256
FEATURES = "layers.1.output.sae.features"
DENSE = "layers.2.output"
K = 3


@pytest.mark.parametrize(
    ("sites", "widths", "topk", "error"),
    [
        ([FEATURES], {}, K, r"needs a sparse autoencoder at layers.1.output; call llm.attach_sae"),
        ([FEATURES], {"layers.1.output": 8}, None, r"top k features per token; give topk=k"),
        ([FEATURES], {"layers.1.output": 8}, 9, r"topk: 9 is more than the 8 features"),
        ([DENSE], {"layers.1.output": 8}, K, r"topk: keeps the largest features of SAE sites"),
        ([FEATURES], {"layers.1.output": 8}, 0, r"topk: expected an int >= 1"),
    ],
)
def test_sae_sites_are_checked_naming_the_fix(sites, widths, topk, error) -> None:
    with pytest.raises(ValueError, match=error):
        check_sae_sites(sites, widths, topk)


def test_an_sae_error_site_is_a_dense_column_and_needs_no_topk() -> None:
    sites = expand_sites(CONFIG, ["layers.1.output.sae.error", FEATURES, DENSE])
    check_sae_sites(sites, {"layers.1.output": 8}, K)
    columns = store_columns(sites, "bfloat16", 256, K)
    assert columns["layers.1.output.sae.error"] == ("uint16", 256)
    assert columns[f"{FEATURES}.indices"] == ("int32", K)
    assert columns[f"{FEATURES}.values"] == ("uint16", K)  # bfloat16 bits, as dense sites
    assert FEATURES not in columns and columns[DENSE] == ("uint16", 256)


def test_saes_are_loaded_from_directories_and_checked_against_the_host(tmp_path: Path) -> None:
    random_sae(256).save(tmp_path / "sae")
    loaded = load_saes(CONFIG, {"layers.1.output": tmp_path / "sae"})
    assert loaded["layers.1.output"].d_sae == 1024
    with pytest.raises(ValueError, match="d_in 128 differs from the hidden size 256"):
        load_saes(CONFIG, {"layers.1.output": random_sae(128)})
    with pytest.raises(FileNotFoundError, match="not an SAE directory"):
        load_saes(CONFIG, {"layers.1.output": tmp_path / "missing"})


def test_the_cli_refuses_a_bad_sae_in_one_line_before_any_engine_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(The fast tier refuses every engine start: these end before one.)"""
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\n")
    random_sae(128).save(tmp_path / "narrow")
    base = ["extract", "--model", str(vinterp.models.tiny("llama")), "--prompts", str(prompts)]
    base += ["--sites", FEATURES, "--topk", "3", "--out", str(tmp_path / "out")]
    for sae, error in [
        ("missing", "not an SAE directory in SAELens's format"),
        ("narrow", "d_in 128 differs from the hidden size 256"),
    ]:
        with pytest.raises(SystemExit, match=error):
            cli.main([*base, "--sae", f"layers.1.output={tmp_path / sae}"])
    with pytest.raises(SystemExit, match="needs a sparse autoencoder at layers.1.output"):
        cli.main(base)
    with pytest.raises(SystemExit):
        cli.main([*base, "--sae", "./sae"])
    assert "expected SITE=DIR" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def spec(saes: dict[str, SAE], topk: int | None, sites: list[str]) -> dict:
    facts = EngineFacts(
        "model",
        "vllm",
        CONFIG,
        EngineLimits("float32", 128, 256),
        {host: SaeFacts.of(sae) for host, sae in saes.items()},
    )
    return extraction_spec(
        facts, prompt_source(["a"], "text"), sites, "all_prompt", 0, "float32", topk
    )


def test_the_spec_holds_k_and_the_digest_of_each_sae_its_sites_read() -> None:
    sae, other = random_sae(256, seed=0), random_sae(256, seed=1)
    unused = {"layers.3.output": random_sae(256, seed=2)}  # attached, read by no site
    base = spec({"layers.1.output": sae, **unused}, K, [FEATURES])
    assert base["topk"] == K and base["sae_digest"] == {"layers.1.output": sae.digest}
    assert spec({"layers.1.output": sae}, K, [FEATURES]) == base
    assert spec({"layers.1.output": other}, K, [FEATURES]) != base
    assert spec({"layers.1.output": sae}, K + 1, [FEATURES]) != base
    dense = spec({"layers.1.output": sae}, None, [DENSE])
    assert "topk" not in dense and "sae_digest" not in dense  # older datasets' specs stay equal


def test_captured_top_k_rows_become_an_index_and_a_value_column(tmp_path: Path) -> None:
    sites = [FEATURES, DENSE]
    columns = store_columns(sites, "float16", 4, K)
    spec = {"sites": sites, "dtype": "float16", "hidden_size": 4, "topk": K}
    about = dataset_about(prompt_source(["a", "b"], "text"), columns)  # lists the columns
    store = ActivationStore.open(tmp_path, spec, columns, ShardSizes(10**6), about)
    g = torch.Generator().manual_seed(0)
    captured = []
    for length in (3, 2):  # the workers' rows: int64 indices, values in the model's dtype
        captured.append(
            {
                f"{FEATURES}.indices": torch.randint(0, 1000, (length, K), generator=g),
                f"{FEATURES}.values": torch.randn(length, K, generator=g),
                DENSE: torch.randn(length, 4, generator=g),
            }
        )
    rows = {
        f"c{k}": {name: {"positions": list(range(len(t))), "values": t} for name, t in c.items()}
        for k, c in enumerate(captured)
    }
    positions = np.array([1, 2], np.int32)
    prompts = [PlannedPrompt(0, [5, 6, 7], positions), PlannedPrompt(1, [8, 9], positions[:1])]
    outputs = [Output(p.ids, [0], "") for p in prompts]
    capture = Capture(sites, positions="all_prompt", topk=K)
    values = shard_columns(prompts, outputs, ["c0", "c1"], capture, store, rows)
    store.add([store.write(0, 0, 2, values, {})])

    def kept(name: str) -> torch.Tensor:  # skip_first drops each prompt's first row
        return torch.cat([captured[0][name][1:], captured[1][name][1:]])

    dataset = datasets.load_from_disk(str(tmp_path))
    assert dataset.features[f"{FEATURES}.indices"].feature.dtype == "int32"  # torch gives int64
    loaded = dataset.with_format("torch")[:]
    assert torch.equal(loaded[f"{FEATURES}.indices"].long(), kept(f"{FEATURES}.indices"))
    assert torch.equal(loaded[f"{FEATURES}.values"], kept(f"{FEATURES}.values").half())
    indices = site_tensor(tmp_path, f"{FEATURES}.indices")
    assert indices.dtype == torch.int32
    assert torch.equal(indices.long(), loaded[f"{FEATURES}.indices"])
    assert torch.equal(site_tensor(tmp_path, f"{FEATURES}.values"), loaded[f"{FEATURES}.values"])
    assert torch.equal(site_tensor(tmp_path, DENSE), kept(DENSE).half())
    with pytest.raises(KeyError, match=f"its sites: {FEATURES}.indices, {FEATURES}.values"):
        site_tensor(tmp_path, FEATURES)


def test_an_sae_site_is_buffered_at_its_host() -> None:
    """The compiled model gathers the host's rows; the worker encodes them after the step."""
    host = "layers.1.output"
    assert engine_settings([FEATURES, DENSE]) == {
        "capture_in_graph": [host, DENSE],
        "capture_in_graph_rows": "step",
        "steering_in_graph": False,
    }
    assert engine_settings([FEATURES, host, f"{host}.sae.error"]) == {
        "capture_in_graph": [host],
        "capture_in_graph_rows": "step",
        "steering_in_graph": False,
    }
    assert engine_settings(FEATURES, "last_prompt")["capture_in_graph_rows"] is None
