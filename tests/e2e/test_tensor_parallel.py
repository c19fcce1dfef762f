"""Worker groups (--tensor-parallel-size 2, --pipeline-parallel-size 2) through the four real
processes: a group exchanges KV with a single worker in either direction, and with a group like
it, each rank sending its own layers and KV heads straight to the caches that hold them; greedy
tokens equal transformers'. A rank killed
mid-stream takes its group out, its requests finish elsewhere with the same tokens, and
`pdserve up` restarts the group."""
import asyncio
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from common.kv_layout import KVLayout
from common.worker.group import process_state
from tests.e2e.conftest import Stack, child_processes, stream_completion
from tests.e2e.test_serve import _body, _greedy, _prompt, hf  # noqa: F401 (a fixture)
from tests.waiting import until

LENGTHS = [1, 16, 17, 123, 300]


def _greedy_all(stack: Stack, prompts: list[list[int]]) -> list[list[int]]:
    async def go():
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as c:
            name = (await c.get("/v1/models")).json()["data"][0]["id"]
            rs = await asyncio.gather(*[c.post("/v1/completions", json=_body(p, model=name))
                                        for p in prompts])
            assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
            return [r.json()["choices"][0]["token_ids"] for r in rs]
    return asyncio.run(go())


@pytest.mark.parametrize("shape", [
    ("--prefill-worker-args=--tensor-parallel-size 2",),
    ("--decode-worker-args=--tensor-parallel-size 2",),
    ("--prefill-worker-args=--pipeline-parallel-size 2",),
    ("--mode", "colocated", "-tp", "2", "-pp", "2"),
    ("--prefill-worker-args=--tensor-parallel-size 2 --kv-transports tcp",
     "--decode-worker-args=--pipeline-parallel-size 2 --kv-transports tcp"),
], ids=["prefill_tp2-decode_tp1", "prefill_tp1-decode_tp2", "prefill_pp2-decode_pp1",
        "colocated_tp2xpp2", "tcp-prefill_tp2-decode_pp2"])
def test_groups_of_any_shape_serve_hf_greedy_tokens(tiny_llama, tmp_path, hf, shape):  # noqa: F811
    stack = Stack(tiny_llama, tmp_path, *shape)
    try:
        groups = {cmd.split("pdserve ", 1)[1].split()[0]: pid
                  for pid, cmd in stack.children().items() if "-worker " in cmd}
        one = [_prompt(n, n) for n in LENGTHS]
        for prompt in one:  # one at a time: each takes the disaggregated path
            assert _greedy_all(stack, [prompt]) == [_greedy(hf, prompt)], len(prompt)
        many = [_prompt(n, 50 + i) for i, n in enumerate([1, 15, 16, 17, 123, 40, 64, 3])]
        assert _greedy_all(stack, many) == [_greedy(hf, p) for p in many]

        s = stack.wait_idle()
        by_role = {w["role"]: w for w in s["workers"]}
        for role, w in by_role.items():
            assert w["num_free_blocks"] == w["num_blocks"], w
            t, p = w.get("tensor_parallel_size", 1), w.get("pipeline_parallel_size", 1)
            # a group's leader started its followers; its endpoint names every rank's cache
            # and the layers and KV heads it holds (the tiny model: 4 layers, 2 KV heads)
            assert len(child_processes(groups[f"{role}-worker"])) >= t * p - 1
            layout = KVLayout(4, 2, 32, 16, "float32", t, p)
            want = [layout.shard(r % t, r // t) for r in range(t * p)]
            parts = [dict(kv.split("=") for kv in ep.split("?")[1].split("&"))
                     for ep in w["kv_endpoint"].split(",")]
            assert [(q["layers"], q["heads"]) for q in parts] == [
                (f"{x.layer_start}-{x.layer_end}", f"{x.head_start}-{x.head_end}")
                for x in want], w["kv_endpoint"]
        if "prefill" not in by_role:  # colocated: no KV moves
            return
        prefill, decode = by_role["prefill"], by_role["decode"]
        assert prefill["kv_blocks_sent"] > 0
        assert decode["kv_blocks_received"] == prefill["kv_blocks_sent"]
        # (under the concurrent batch the decode worker may take a short prompt itself)
        assert prefill["prompt_tokens_computed"] >= sum(LENGTHS)
        per_rank = [int(b) for b in prefill["kv_bytes_sent_per_rank"]]
        # every rank sent its own layers and heads, none gathered another's: equal shares
        assert len(per_rank) == prefill.get("tensor_parallel_size", 1) * \
            prefill.get("pipeline_parallel_size", 1)
        assert min(per_rank) > 0 and len(set(per_rank)) == 1, per_rank
    finally:
        stack.stop()


def test_a_rank_killed_or_frozen_mid_stream_takes_its_group_out_and_nothing_is_lost(
        tiny_llama, tmp_path, hf):  # noqa: F811
    """Two decode groups; SIGKILL of a group's follower while 8 streams decode, then, once the
    group is back, SIGSTOP of one (alive, but it takes part in nothing) while 8 more do: each
    time its leader leaves, the scheduler re-queues the group's requests, they finish on the
    other group (or the restarted one) with the tokens of an undisturbed run, the follower has
    ended, and `pdserve up` restarts the group, which serves again."""
    stack = Stack(tiny_llama, tmp_path, "--decode-workers", "2",
                  "--decode-worker-args=--tensor-parallel-size 2", "--num-scheduler-steps", "1")
    try:
        # a killed rank's leader may see the step's collective fail before the exit (either
        # names the group broken); a frozen one's collective waits, and only the watch can tell.
        # The prompts' greedy tokens meet no eos token (transformers' min_new_tokens masks it,
        # ignore_eos does not)
        rounds = [(signal.SIGKILL, "", 200),
                  (signal.SIGSTOP, "rank 1 has been stopped for 5 s", 220)]
        for times, (sig, broken, seed) in enumerate(rounds, 1):
            prompts = [_prompt(20 + 7 * i, seed + i) for i in range(8)]
            want = [_greedy(hf, p, 64) for p in prompts]
            under_way = threading.Event()
            body = {"max_tokens": 64, "temperature": 0, "ignore_eos": True}
            with ThreadPoolExecutor(8) as pool:
                running = [pool.submit(stream_completion, stack.url, {**body, "prompt": p},
                                       0, lambda n: n >= 8 and under_way.set()) for p in prompts]
                assert under_way.wait(120), "no stream got under way"
                leaders = [pid for pid, cmd in stack.children().items()
                           if "decode-worker " in cmd]
                victim = next(f for leader in leaders
                              for f, cmd in child_processes(leader).items() if "spawn_main" in cmd)
                os.kill(victim, sig)
                got = [f.result()[0] for f in running]
            assert got == want, signal.Signals(sig).name
            deadline = time.monotonic() + 120
            while stack.log.read_text().count("exited with 1; restarting it") < times:
                assert time.monotonic() < deadline, stack.log.read_text()[-3000:]
                time.sleep(0.5)
            assert f"worker group broken: {broken}" in stack.log.read_text()
            # ended (gone, or a zombie), a frozen one too: its leader killed it
            assert process_state(victim) in (None, b"Z", b"X")
            until(lambda: len([w for w in stack.stats()["workers"] if w["role"] == "decode"]) >= 2,
                  120.0, "the group's return", every_s=0.5)
        again = [_prompt(33, 300 + i) for i in range(4)]
        assert _greedy_all(stack, again) == [_greedy(hf, p) for p in again]
        s = stack.wait_idle()
        assert all(w["num_free_blocks"] == w["num_blocks"] for w in s["workers"])
    finally:
        stack.stop()


def test_groups_ride_through_a_scheduler_killed_mid_stream(tiny_llama, tmp_path,
                                                           hf):  # noqa: F811
    """SIGKILL of the scheduler while 8 streams decode on T=2 groups (prefill and decode,
    multi-step plans; T=2 -> T=2 KV): each leader finishes the plan its followers have,
    re-attaches to the restarted scheduler with its group in step, and the streams end with the
    tokens of an undisturbed run (the first also transformers'); no group is restarted."""
    stack = Stack(tiny_llama, tmp_path, "-tp", "2", "--num-scheduler-steps", "4")
    try:
        prompts = [_prompt(20 + 7 * i, 400 + i) for i in range(8)]
        under_way = threading.Event()
        body = {"max_tokens": 64, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(8) as pool:
            # (greedy past an eos token, which transformers' min_new_tokens would mask)
            want = [ids for ids, _ in pool.map(
                lambda p: stream_completion(stack.url, {**body, "prompt": p}), prompts)]
            assert want[0] == _greedy(hf, prompts[0], 64)
            running = [pool.submit(stream_completion, stack.url, {**body, "prompt": p},
                                   0, lambda n: n >= 8 and under_way.set()) for p in prompts]
            assert under_way.wait(120), "no stream got under way"
            scheduler = [pid for pid, cmd in stack.children().items() if " scheduler " in cmd]
            os.kill(scheduler[0], signal.SIGKILL)
            got = [f.result()[0] for f in running]
        assert got == want
        again = [_prompt(33, 500 + i) for i in range(4)]
        assert _greedy_all(stack, again) == [_greedy(hf, p) for p in again]
        log = stack.log.read_text()
        assert "scheduler` exited with -9; restarting it" in log
        assert "worker group broken" not in log and "-worker` exited" not in log
        s = stack.wait_idle()
        assert all(w["num_free_blocks"] == w["num_blocks"] for w in s["workers"])
    finally:
        stack.stop()
