"""The bench's report writers and its timing statistics, without an engine."""

from __future__ import annotations

import gc
import json
import time

import pytest

from vinterp.bench import report
from vinterp.bench.harness import REFERENCE, Row, ratio_interval, timed_interleaved
from vinterp.bench.peers.row import PeerRow
from vinterp.bench.peers.timing import Timing, measure

MACHINE = {
    "device": "Test CPU",
    "device_kind": "cpu",
    "cpus": 2,
    "dtype": "float32",
    "model": "/models/tiny",
    "date": "2026-11-24T10:00:00",
}


def sample() -> report.Report:
    plain = Timing((1.0, 1.2, 0.8))
    rows = [
        Row(
            "steering layers.10.output (64x32)",
            plain,
            Timing((1.02, 1.0, 1.04)),
            1.05,
            "steer",
            2048,
        ),
        Row(
            "capture layers.*.output all",
            plain,
            Timing((2.0, 2.0, 2.0)),
            1.5,
            "capture_layers_all",
            2048,
        ),
        Row(
            "plain vLLM enforce_eager=True",
            plain,
            Timing((3.0, 3.0, 3.0)),
            REFERENCE,
            "eager",
            2048,
        ),
    ]
    peers = [
        PeerRow("extract", "vinterp (vLLM engine)", "0.1.0", Timing((0.5, 0.5)), "reference", 0.5),
        PeerRow("extract", "HF transformers + hooks", "5.19", Timing((5.0, 6.0)), "ok", 0.5),
        PeerRow(
            "extract", "fast but wrong", "1.0", Timing((0.1, 0.1)), "WRONG: layers [3] differ", 0.5
        ),
        PeerRow("steer", "vinterp (vLLM engine)", "0.1.0", Timing((2.0, 2.0)), "reference", 2.0),
        PeerRow("steer", "broken | tool", "?", None, "error: RuntimeError: no GPU", 2.0),
    ]
    return report.Report(MACHINE, "vinterp bench --quick", rows, peers)


def test_timing_is_the_median_and_spread_of_the_repeats_after_a_warm_up() -> None:
    times = Timing((1.0, 3.0, 2.0))
    assert times.median == 2.0 and times.best == 1.0 and times.spread == pytest.approx(1.0)
    calls = []
    timing, last = measure(lambda: calls.append(len(calls)) or len(calls), 3)
    assert len(calls) == 4 and len(timing.times) == 3 and last == 4  # one warm-up, untimed


def test_interleaved_timing_runs_workloads_in_rounds() -> None:
    """After one warm-up each, every round runs every workload once, so a machine that
    slows down over the run slows every workload alike."""
    calls: list[str] = []
    clock = iter(range(100))  # a machine that gets slower with every run
    slow = {
        key: (lambda key=key: calls.append(key) or time.sleep(next(clock) * 1e-2)) for key in "ab"
    }
    timings = timed_interleaved(slow, 3)
    assert calls == ["a", "b"] + ["a", "b"] * 3
    assert [len(timings[k].times) for k in "ab"] == [3, 3]
    assert timings["a"].median < timings["b"].median < 1.5 * timings["a"].median


def test_each_timed_run_starts_after_a_garbage_collection() -> None:
    """A run that leaves cyclic garbage behind does not hand its collection to the next one:
    every timed run starts with the collector's young generation empty."""
    counts: list[int] = []

    def littering() -> None:
        counts.append(gc.get_count()[0])
        for _ in range(300):
            cycle: list = []
            cycle.append(cycle)

    timed_interleaved({"a": littering, "b": littering}, 3)
    assert max(counts[2:]) < 50  # the two warm-ups run without a collection first


def test_rows_and_peer_rows_compare_medians() -> None:
    rep = sample()
    steer, capture, eager = rep.rows
    assert steer.ratio == pytest.approx(1.02 / 1.0) and steer.verdict == "ok (within noise)"
    assert capture.verdict == "OVER TARGET" and eager.verdict == "reference"
    assert steer.tokens_per_s == pytest.approx(2048 / 1.02)
    hf, wrong = rep.peers[1], rep.peers[2]
    assert hf.vs_vinterp == pytest.approx(5.5 / 0.5) and not hf.wrong
    assert wrong.wrong and rep.peers[4].vs_vinterp is None and not rep.peers[4].ran


def test_the_ratio_interval_says_when_the_rounds_cannot_decide_a_target() -> None:
    quiet = Row("q", Timing((1.0, 1.01, 0.99, 1.0, 1.0)), Timing((1.1, 1.11, 1.09, 1.1, 1.1)), 1.05)
    assert quiet.interval[0] > 1.05 and quiet.verdict == "OVER TARGET"
    noisy = Row("n", Timing((1.0, 1.3, 0.8, 1.2, 0.9)), Timing((1.1, 0.9, 1.3, 1.0, 1.2)), 1.05)
    low, high = noisy.interval
    assert low < noisy.ratio < high and low <= 1.05 < high
    assert noisy.verdict == "OVER TARGET (within noise)"  # 1.10x, but the rounds allow 1.05x


def test_rounds_are_drawn_in_pairs_so_a_slow_round_slows_both_sides() -> None:
    """Interleaved rounds: the machine's state in a round reaches plain vLLM and vinterp alike,
    so a constant ratio on a machine whose speed swings has a narrow interval; the same times
    not paired by round (unequal counts) do not."""
    swinging = Timing((1.0, 2.0, 3.0, 4.0, 5.0))
    steady = Timing(tuple(1.02 * t for t in swinging.times))
    assert ratio_interval(steady, swinging) == pytest.approx((1.02, 1.02))
    low, high = ratio_interval(steady, Timing((*swinging.times, 3.0)))
    assert high - low > 0.5


def test_json_markdown_and_png_are_written(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    paths = report.write(sample(), tmp_path)
    assert [p.name for p in paths] == ["bench.json", "bench.md", "bench.png"]
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["machine"]["device"] == "Test CPU" and doc["command"] == "vinterp bench --quick"
    assert doc["rows"][0]["vinterp"]["median_s"] == 1.02
    assert doc["rows"][0]["vinterp"]["spread"] == pytest.approx(0.04 / 1.02)
    assert doc["rows"][2]["target"] is None
    assert doc["rows"][1]["ratio_interval"] == pytest.approx([2.0 / 1.2, 2.0 / 0.8])
    assert doc["peers"][1]["vs_vinterp"] == pytest.approx(11.0)
    assert doc["peers"][4]["timing"] is None and doc["peers"][4]["check"].startswith("error:")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_has_every_row_and_says_why_a_peer_did_not_run() -> None:
    text = report.markdown(sample())
    assert "Test CPU" in text and "`vinterp bench --quick`" in text
    assert (
        "| steering layers.10.output (64x32) | 1.000 | 1.020 | ±2% | 2008 | 1.02x | 0.83-1.30x"
        " | <= 1.05x | ok (within noise) |" in text
    )
    assert "OVER TARGET" in text and "| reference |" in text
    assert "| HF transformers + hooks | 5.19 | 5.500 | ±9% | 11.00x | ok |" in text
    assert "WRONG: layers [3] differ" in text
    assert "| broken | tool |" not in text and "broken \\| tool" in text  # cells stay cells
    assert "error: RuntimeError: no GPU" in text
    table_rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table_rows) == 3 + 5 + 3  # rows, peer rows, three header lines


def test_cli_writes_the_report_files_and_the_json(tmp_path, capsys) -> None:
    """`--workloads none --peers none` starts no engine: the command's wiring alone."""
    from vinterp.cli import main
    from vinterp.models import tiny

    out, json_path = tmp_path / "out", tmp_path / "rows.json"
    model = str(tiny("llama"))
    main(["bench", "--quick", "--model", model, "--workloads", "none", "--peers", "none",
          "--out", str(out), "--json", str(json_path)])  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md"]  # nothing to draw
    doc = json.loads(json_path.read_text())
    assert doc == json.loads((out / "bench.json").read_text())
    assert doc["machine"]["model"] == model and doc["rows"] == [] and doc["peers"] == []
    assert "Measured" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "--peers", "hf_hooks,no_such_tool"])
