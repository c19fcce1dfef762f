"""A worker with its model and KV cache on the GPU (triton backend) produces the same greedy
tokens as the CPU worker, through prefill, decode and a layer-by-layer tcp send."""
import asyncio
import threading
import uuid

import pytest
import torch

from common.worker.config import WorkerConfig
from common.worker.service import build_worker, start_listeners
from common.plans import KVSend, NewRequest, ScheduledTokens, StepPlan
from common.sampling_params import SamplingParams

pytestmark = pytest.mark.cuda


def _run(worker, prompt, steps):
    plan = StepPlan(1, new_requests=[NewRequest(
        "r", tuple(prompt), len(prompt), 0, tuple(range(8)), SamplingParams(max_tokens=steps))],
        scheduled=[ScheduledTokens("r", len(prompt))])
    tokens = [worker.execute(plan).sampled[0].token_id]
    for k in range(steps - 1):
        step = StepPlan(2 + k, scheduled=[ScheduledTokens("r", 1)])
        tokens.append(worker.execute(step).sampled[0].token_id)
    return tokens


def test_cuda_worker_matches_the_cpu_worker(tiny_llama):
    prompt = torch.randint(0, 2000, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    made = []
    try:
        for device in ("cpu", "cuda"):
            w, _ = build_worker(WorkerConfig(
                role="decode", model=str(tiny_llama), worker_id=f"cuda-test-{uuid.uuid4().hex[:6]}",
                num_kv_blocks=16, device=device, kv_transports=("tcp",),
                attention_backend="torch" if device == "cpu" else "triton"))
            made.append(w)
        cpu, gpu = made
        assert gpu.cache.tensor.is_cuda
        assert _run(gpu, prompt, 12) == _run(cpu, prompt, 12)
    finally:
        for w in made:
            w.close()


def test_cuda_kv_streams_layer_by_layer_over_tcp(tiny_llama):
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    cfg = dict(model=str(tiny_llama), num_kv_blocks=16, device="cuda", kv_transports=("tcp",))
    src, _ = build_worker(WorkerConfig(role="prefill", worker_id="cuda-src", **cfg))
    dst, dst_reg = build_worker(WorkerConfig(role="decode", worker_id="cuda-dst", **cfg))
    asyncio.run_coroutine_threadsafe(start_listeners(dst, dst_reg), loop).result(30)
    prompt = list(range(40))
    plan = StepPlan(1, new_requests=[NewRequest(
        "r", tuple(prompt), 40, 0, (0, 1, 2), SamplingParams(max_tokens=1))],
        scheduled=[ScheduledTokens("r", 40)],
        sends=[KVSend("t", "r", (0, 1, 2), (5, 6, 7), dst_reg.kv_endpoints["tcp"], "tcp")])
    dst.receiver.expect("t", "r", [5, 6, 7], "tcp")
    src.execute(plan)
    done = src.send_kv(plan.sends)
    assert not done.done[0].error
    torch.testing.assert_close(dst.cache.tensor[:, :, 5:8], src.cache.tensor[:, :, 0:3],
                               rtol=0, atol=0)
    loop.call_soon_threadsafe(loop.stop)
