"""The throughput benchmark's ratios at defaults (benchmarks/bench.py), with hand-worked values."""

import sys
from pathlib import Path

import pytest


sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench  # noqa: E402


def _row(items, cpu_seconds):
    samples = items * 4  # K=4 joint samples per item
    return {"settings": {"items": items}, "cpu_seconds": cpu_seconds, "joint_samples_per_cpu_s": samples / cpu_seconds}


def test_the_long_smollm2_rows_give_the_amortised_and_marginal_ratios():
    by = {
        ("smollm2 N=2 K=4 defaults", "ours"): _row(4, 26.0),
        ("smollm2 N=2 K=4 defaults", "peer"): _row(4, 52.0),
        ("smollm2 N=2 K=4 defaults 12 items", "ours"): _row(12, 48.0),
        ("smollm2 N=2 K=4 defaults 12 items", "peer"): _row(12, 114.0),
    }
    out = bench.summarize_defaults(by)
    assert out["smollm2 defaults: samples per CPU-s ours/peer (N=2, K=4; target >= 3)"] == pytest.approx(2.0)
    # 12 items: 48 samples in 48 CPU-s against 48 in 114
    assert out["smollm2 defaults, 12 items (extra row): samples per CPU-s ours/peer"] == pytest.approx(114 / 48)
    # the 8 items between: (114 - 52) / 8 = 7.75 CPU-s each for the peer, (48 - 26) / 8 = 2.75 for ours
    assert out["smollm2 defaults, items 5-12 (extra row): CPU-s per item peer/ours"] == pytest.approx(7.75 / 2.75)
    # what does not grow with the items: 26 - 4 * 2.75 = 15 CPU-s for ours, 52 - 4 * 7.75 = 21 for the peer
    assert out["smollm2 defaults (extra row): one-time CPU-s, ours"] == pytest.approx(15.0)
    assert out["smollm2 defaults (extra row): one-time CPU-s, peer"] == pytest.approx(21.0)
    # even if our items cost nothing, four items would be 52 CPU-s against our 15
    assert out["smollm2 defaults (extra row): four-item ratio if our items cost nothing"] == pytest.approx(52 / 15)


def test_without_the_long_rows_there_is_no_amortised_ratio():
    by = {
        ("smollm2 N=2 K=4 defaults", "ours"): _row(4, 26.0),
        ("smollm2 N=2 K=4 defaults", "peer"): _row(4, 52.0),
        ("smollm2 N=2 K=4 defaults 12 items", "ours"): _row(12, 48.0),
    }
    assert not any("extra row" in key for key in bench.summarize_defaults(by))


def test_the_default_plan_has_the_long_rows_for_both_systems_only_on_smollm2():
    rows = bench.plan_defaults({"tiny": "tiny-path", "smollm2": "smol-path"})
    long = [(system, settings) for label, system, settings in rows if label.endswith("12 items")]
    assert [system for system, _ in long] == ["ours", "peer"]
    assert all(s["items"] == 12 and s["agents"] == 2 and s["model"] == "smol-path" for _, s in long)
    assert all(s["items"] == 4 for label, _, s in rows if label.startswith("smollm2") and "12 items" not in label)
