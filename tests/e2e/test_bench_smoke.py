"""benchmarks/serve.py in a tiny form: it launches a stack, loads it and writes its files (the
figures are measured by hand, never in tests)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_serving_benchmark_writes_its_files(tiny_llama, tmp_path):
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--model", str(tiny_llama),
         "--workload", "mixed", "--num-requests", "3", "--rates", "4", "8", "--max-tokens", "3",
         "--spans", "--cores", "--out", str(out)], capture_output=True, text=True, timeout=300,
        cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for name in ("requests.json", "summary.json", "ttft_tpot_cdf.png", "timeline.png",
                 "goodput.png", "cores.json", "cores.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())["targets"]["pdserve (defaults)"]
    assert set(summary) == {"4.0", "8.0"} and summary["4.0"]["failed"] == 0
    # --cores: where the cores went during each rate's load, by process, the client's included
    used = json.loads((out / "cores.json").read_text())["pdserve (defaults)"]
    assert set(used) == {"4.0", "8.0"}
    for u in used.values():
        assert "serve.py" in u["processes"] and u["wall_s"] > 0, u
        assert any(n.startswith("pdserve ") for n in u["processes"]), u
    assert "where the cores went, at 4.0 req/s" in done.stdout
    # --spans: each request's phases from the stack's own spans, on the client's clock
    for rate, recs in json.loads((out / "requests.json").read_text())[
            "pdserve (defaults)"].items():
        for r in recs:
            names = [p[0] for p in r["phases"]]
            assert names[0] == "queue" and names[-1] == "decode", (rate, names)
            assert {"prefill", "local"} & set(names), (rate, names)
            # each prefill step with its tokens (what the prefix cache did not hold) and the
            # threads its cores gave it
            steps = [p for p in r["phases"] if p[0] in ("prefill", "local")]
            assert 0 < sum(p[4] for p in steps) <= r["prompt_tokens"], steps
            assert all(p[5] in (1, 2) for p in steps), steps
            assert r["start"] - 0.05 <= r["phases"][0][1] <= r["phases"][-1][2] <= r["end"] + 0.05


def test_the_idle_workload_sends_one_request_at_a_time(tiny_llama, tmp_path):
    out = tmp_path / "idle"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--model", str(tiny_llama),
         "--workload", "idle", "--num-requests", "3", "--max-tokens", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "median TTFT by prompt length, one request at a time" in done.stdout
    recs = json.loads((out / "requests.json").read_text())["pdserve (defaults)"]["-1.0"]
    assert [r["prompt_tokens"] for r in recs] == [128, 1024, 3000]
    for before, after in zip(recs, recs[1:]):  # each starts once the one before has ended
        assert after["start"] >= before["end"]


def test_the_tensor_parallel_benchmark_writes_its_files(tiny_llama, tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tensor_parallel.py"), "--model",
         str(tiny_llama), "--prompt", "16", "--batch", "2", "--reps", "1", "--blocks", "4",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "tensor_parallel.json").read_text())
    assert set(result["steps"]) == {"T=1 P=1", "T=2 P=1", "T=1 P=2 x1 micro", "T=1 P=2 x2 micro"}
    assert set(result["transfers"]) == {f"{t} T={a}->{b}" for t in ("shm", "tcp")
                                        for a, b in ((1, 1), (2, 2), (2, 1), (1, 2))}
    assert (tmp_path / "tensor_parallel.png").stat().st_size > 0


def test_the_linears_benchmark_writes_its_files(tiny_llama, tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "linears.py"), "--model", str(tiny_llama),
         "--rows", "1", "7", "--threads", "1", "--reps", "1", "--seqs", "4", "--out",
         str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "linears.json").read_text())
    assert [(r["threads"], r["rows"], r["head_rows"]) for r in result["results"]] == \
        [(1, 1, 1), (1, 7, 4)]
    assert all(len(r["oneDNN_ms"]) == len(r["panels_ms"]) == 1 for r in result["results"])
    assert (tmp_path / "linears.png").stat().st_size > 0
