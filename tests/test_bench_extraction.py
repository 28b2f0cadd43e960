"""The extraction rows of `vinterp bench` (bench/extraction.py): prompts of a given token
count, model shapes without weights, and, on the CPU engine, the rows of `llm.extract` and
of HF's forward hooks against plain vLLM's prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

import vinterp
from vinterp import cli
from vinterp.bench import extraction
from vinterp.bench.harness import REFERENCE, target, timed_interleaved


@pytest.mark.parametrize("model", ["bundled", "tiny"])
def test_prompts_have_the_asked_token_count_and_differ(model: str) -> None:
    path = vinterp.models.bundled() if model == "bundled" else vinterp.models.tiny("llama")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    for prompts, tokens in ((8, 32), (16, 256)):
        texts = extraction.prompt_texts(tokenizer, prompts, tokens)
        assert len(texts) == prompts and len(set(texts)) == prompts
        counts = [len(ids) for ids in tokenizer(texts).input_ids]
        assert all(tokens - 1 <= n <= tokens for n in counts), counts


def test_spaced_layers_sit_in_the_middle_of_equal_shares() -> None:
    assert extraction.spaced_layers(32, 4) == [4, 12, 20, 28]
    assert extraction.spaced_layers(30, 2) == [7, 22]
    assert extraction.spaced_layers(2, 4) == [0, 1]


def test_shape_only_writes_a_config_and_tokenizer_without_weights(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VINTERP_CACHE_DIR", str(tmp_path))
    path = vinterp.models.shape_only(**vinterp.models.LLAMA_3_8B)
    assert path.parent == tmp_path
    assert not [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")]
    config = AutoConfig.from_pretrained(str(path))
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.intermediate_size) == (4096, 14336)
    assert (config.num_hidden_layers, config.num_attention_heads) == (32, 32)
    assert (config.num_key_value_heads, config.head_dim) == (8, 128)
    assert (config.vocab_size, config.max_position_embeddings) == (128256, 8192)
    assert config.rope_parameters["rope_theta"] == 500000
    assert str(config.dtype).removeprefix("torch.") == "bfloat16"
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert max(tokenizer("The capital of France is").input_ids) < config.vocab_size
    assert vinterp.models.shape_only(**vinterp.models.LLAMA_3_8B) == path  # cached


def test_the_70b_shape_is_llama_3_70bs(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VINTERP_CACHE_DIR", str(tmp_path))
    model, load_format = cli._bench_model("llama-3-70b-shape", None)
    config = AutoConfig.from_pretrained(str(model))
    assert load_format == "dummy"
    assert (config.hidden_size, config.intermediate_size) == (8192, 28672)
    assert (config.num_hidden_layers, config.num_attention_heads) == (80, 64)
    assert (config.num_key_value_heads, config.head_dim) == (8, 128)


def test_bench_resolves_a_shape_name_to_random_weights(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VINTERP_CACHE_DIR", str(tmp_path))
    model, load_format = cli._bench_model("llama-3-8b-shape", None)
    assert load_format == "dummy" and Path(model).parent == tmp_path
    with pytest.raises(SystemExit, match="no weights"):
        cli._bench_model("llama-3-8b-shape", "auto")
    assert cli._bench_model("some/dir", None) == ("some/dir", None)


# the dense rows and HF's (the SAE row starts an SAE of its own: its bytes are checked by the
# extraction tests of tests/test_engine_tiny_extract_sae.py, not here)
DENSE = tuple(k for k in extraction.KEYS if k != extraction.EXTRACT_SAE)


@pytest.mark.engine("bench_extraction")
@pytest.mark.usefixtures("in_process")
def test_extraction_rows_time_extract_and_hf_hooks_against_plain_prefill(
    engines, tiny_llama, tmp_path
) -> None:
    """Tiny llama (4 layers, hidden 256, float32; eager engines: the rows' plumbing is under
    test): each row has times, and the bytes it reports equal rows x sites x hidden x 4."""
    engines.release()  # these rows start their own engines
    done: list[str] = []
    rows = extraction.run(
        tiny_llama,
        prompts=8,
        prompt_tokens=32,
        repeats=1,
        dtype="float32",
        selected=set(DENSE),
        extract_dir=tmp_path,
        progress=done.append,
        enforce_eager=True,
    )
    assert done == list(DENSE)
    assert [r.key for r in rows] == list(DENSE[:3]) + [extraction.EXTRACT_HF] * 3
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    texts = extraction.prompt_texts(tokenizer, 8, 32)
    tokens = sum(len(ids) for ids in tokenizer(texts).input_ids)
    hidden, itemsize = 256, 4
    expected = {
        "extract_layers_all": tokens * 2 * hidden * itemsize,  # layers 1 and 3 (2 on the CPU)
        "extract_layers_last": 8 * 4 * hidden * itemsize,  # every layer, one row a prompt
        "extract_mid_depth": tokens * hidden * itemsize,  # layer 2, on an engine of 3 layers
    }
    assert "layers.2.output of 4 layers" in rows[2].name and "stopped there" in rows[2].name
    plain = rows[0].baseline
    for row, key, ours in zip(rows, [*expected, *expected], [*rows[:3], *rows[:3]]):
        assert row.baseline is plain and plain.median > 0 and row.measured.median > 0
        assert row.tokens == tokens
        assert ours.key == key and ours.name in row.name  # the HF row names what it repeats
        if row.key == extraction.EXTRACT_HF:
            assert row.target == REFERENCE and "host memory" in row.name
            assert row.extras["gb_collected"] * 1e9 == pytest.approx(expected[key], abs=0.5)
            assert row.extras["hf_batch"] in extraction.HF_BATCHES
            assert row.extras["vinterp_throughput_x_hf"] > 0
        else:
            assert row.target == target(key)
            assert row.extras["gb_written"] * 1e9 == pytest.approx(expected[key], abs=0.5)
            assert row.extras["gb_per_s"] > 0
            assert row.extras["store_alone_s"] > 0
            assert row.extras["engine_waited_s"] >= 0 and row.extras["writers_waited_s"] >= 0
    assert list(tmp_path.iterdir()) == []  # every run's folder deleted


def test_warm_ups_run_a_sixteenth_of_the_prompts_but_at_least_the_largest_batch() -> None:
    assert extraction.warm_up(list(range(4096))) == list(range(256))
    assert extraction.warm_up(list(range(100))) == list(range(64))
    assert extraction.warm_up(list(range(10))) == list(range(10))


def test_timed_interleaved_warms_up_with_the_given_call_instead_of_a_full_run() -> None:
    calls: list[str] = []
    times = timed_interleaved(
        {"job": lambda: calls.append("full")},
        repeats=2,
        cleanup={"job": lambda: calls.append("cleanup")},
        warm={"job": lambda: calls.append("warm")},
    )
    assert calls == ["warm", "cleanup", "full", "cleanup", "full", "cleanup"]
    assert len(times["job"].times) == 2


def test_timed_runs_keep_their_folders_while_the_disk_has_room(tmp_path, monkeypatch) -> None:
    """A run's folder is deleted between timed runs only when the disk could not hold two
    more such runs (deleting is the bench's cleanup, kept out of the next run's time)."""
    runs = extraction.RunFolders(tmp_path, "run-")
    for _ in range(2):
        (runs.new() / "shard").write_bytes(bytes(1000))
        runs.done()
    assert len(list(tmp_path.iterdir())) == 2
    usage = extraction.shutil.disk_usage(tmp_path)
    short = usage._replace(free=2 * 1000 + runs.SPARE - 1)
    monkeypatch.setattr(extraction.shutil, "disk_usage", lambda _path: short)
    (runs.new() / "shard").write_bytes(bytes(1000))
    runs.done()
    assert list(tmp_path.iterdir()) == []
    (runs.new() / "shard").write_bytes(bytes(10))
    runs.close()
    assert list(tmp_path.iterdir()) == []
