"""benchmarks/loadgen.py summarize: the figures of a run, and the mean TTFT of long and short
prompts apart where the workload mixes them."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
loadgen = pytest.importorskip("loadgen")


def _record(prompt_tokens, ttft, error=""):
    return loadgen.Record(prompt_tokens, start=1.0, first=1.0 + ttft, end=2.0 + ttft,
                          gaps=[0.05, 0.15], tokens=0 if error else 3, error=error)


def test_long_and_short_prompts_mean_ttft_apart_failed_ones_left_out():
    records = [_record(100, 0.2), _record(150, 0.4), _record(2500, 3.0), _record(3000, 5.0),
               _record(3500, 60.0, error="timeout")]
    s = loadgen.summarize(records, wall=10.0, slo_ttft_s=2.0, slo_tpot_s=0.1, long_from=2000)
    assert s["requests"] == 5 and s["failed"] == 1
    assert s["TTFT mean long"] == pytest.approx(4000.0)
    assert s["TTFT mean short"] == pytest.approx(300.0)
    assert s["out tok/s"] == pytest.approx(1.2)
    assert s["goodput req/s"] == pytest.approx(0.2)  # the short two: TPOT 100 ms, TTFT <= 2 s
    assert "TTFT mean long" not in loadgen.summarize(records, 10.0, 2.0, 0.1)


def test_the_split_follows_the_workloads_long_prompts():
    long_frac, (lo, hi) = loadgen.LONG_PROMPTS["bimodal"]
    prompts = loadgen.workload("bimodal", 200, seed=3)
    long = [p for p in prompts if len(p) >= lo]
    assert all(lo <= len(p) <= hi for p in long)
    assert all(50 <= len(p) <= 200 for p in prompts if len(p) < lo)
    assert 0.1 < len(long) / len(prompts) < 0.3
