"""benchmarks/serve.py --seeds: the ratios of each target to the first, per seed, summarized as
their median and range over the seeds."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
serve = pytest.importorskip("serve")


def test_ratios_to_the_first_target_over_seeds():
    def draw(base_tps, other_tps, other_ttft):
        return {"vllm": {1.5: {"out tok/s": base_tps, "TTFT p99": 100.0, "requests": 60}},
                "pdserve": {1.5: {"out tok/s": other_tps, "TTFT p99": other_ttft,
                                  "requests": 60}}}
    ratios = serve.seed_ratios({1: draw(100, 90, 50.0), 2: draw(100, 120, 200.0),
                                3: draw(200, 220, 100.0)}, "vllm")
    assert list(ratios) == ["pdserve"]
    cells = ratios["pdserve"]["1.5"]
    assert set(cells) == {"out tok/s", "TTFT p99"}  # counts are not ratios
    assert cells["out tok/s"] == pytest.approx({"median": 1.1, "min": 0.9, "max": 1.2})
    assert cells["TTFT p99"] == pytest.approx({"median": 1.0, "min": 0.5, "max": 2.0})


def test_a_figure_the_first_target_lacks_or_has_at_zero_gets_no_ratio():
    ratios = serve.seed_ratios({1: {"a": {0.0: {"goodput req/s": 0.0}},
                                    "b": {0.0: {"goodput req/s": 0.4}}}}, "a")
    assert ratios == {}


def test_stacks_launched_side_by_side_on_a_gpu_split_its_memory():
    def flags(shapes, up_args="", baseline=()):
        args = serve.argparse.Namespace(shapes=shapes, up_args=up_args, baseline=list(baseline))
        return [f for _, _, f in serve.targets(args)]

    eager = serve.SHAPES["eager"][1]
    assert flags(["default", "eager"], "--device cuda") == [
        ["--device", "cuda", "--gpu-memory-utilization", "0.4500"],
        [*eager, "--device", "cuda", "--gpu-memory-utilization", "0.4500"]]
    assert flags(["default", "eager", "colocated"], "--device=cuda:1")[0] == [
        "--device=cuda:1", "--gpu-memory-utilization", "0.3000"]
    # one stack beside a running baseline keeps the launcher's own share
    assert flags(["default"], "--device cuda", ["vllm=http://x"]) == [[], ["--device", "cuda"]]
    assert flags(["default", "eager"]) == [[], eager]  # CPU stacks have no such memory
    assert flags(["default", "eager"], "--device cuda --device cpu") == [
        ["--device", "cuda", "--device", "cpu"], [*eager, "--device", "cuda", "--device", "cpu"]]
    # a fraction given by hand is the user's
    assert flags(["default", "eager"], "--device cuda --gpu-memory-utilization 0.8")[0] == [
        "--device", "cuda", "--gpu-memory-utilization", "0.8"]


@pytest.mark.parametrize("name", ["bimodal", "random", "shared-prefix"])
def test_each_rate_of_a_sweep_draws_its_own_prompts(name):
    """The same prompts at every rate would be prefix-cache hits from the second rate on."""
    args = serve.argparse.Namespace(workload=name, num_requests=6)

    def endings(by_rate):  # each prompt's last 20 tokens, over every rate's draw
        return [tuple(p[-20:]) for draw in by_rate.values() for p in draw]

    by_rate = serve.draws(args, [1.5, 2.5, 3.5], seed=7)
    assert list(by_rate) == [1.5, 2.5, 3.5]
    first = endings(by_rate)
    assert len(set(first)) == len(first)  # no prompt ends as another one does
    # the first rate draws what a single-rate run with this seed draws
    assert by_rate[1.5] == serve.workload(name, 6, 7)
    assert serve.draws(args, [1.5], seed=7) == {1.5: by_rate[1.5]}
    # --seeds 7 8 run on the same servers: the next seed's sweep shares no draw with this one's
    assert not set(endings(serve.draws(args, [1.5, 2.5, 3.5], seed=8))) & set(first)
