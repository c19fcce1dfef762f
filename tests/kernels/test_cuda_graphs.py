"""Decode steps from static, padded buffers (CUDA graphs on a GPU, the same buffers run eagerly
under the Triton interpreter on CPU) give the eager forward's hidden states and KV writes, and a
worker serving from graphs samples the tokens an eager one does."""
import uuid

import pytest
import torch

from common.models.attention import AttentionMetadata, create_attention_backend
from common.models.llama import load_model
from common.worker.cuda_graphs import DecodeGraphs, batch_buckets
from tests.kernels.paged import DEVICE

BLOCK = 16
NUM_BLOCKS = 24


def test_buckets_are_fine_for_small_batches_and_end_at_the_largest():
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160,
                                  192, 224, 256]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]


@pytest.mark.parametrize("num_decodes", [1, 3, 6])
def test_padded_decode_matches_the_eager_forward(tiny_llama, num_decodes):
    dtype = torch.float32
    model = load_model(tiny_llama, create_attention_backend("triton", DEVICE), dtype, DEVICE)
    c = model.config
    cache = torch.randn((c.num_layers, 2, NUM_BLOCKS, BLOCK, c.num_kv_heads, c.head_dim),
                        generator=torch.Generator().manual_seed(1)).to(DEVICE)
    layers = list(cache.unbind(0))
    graphs = DecodeGraphs(model, layers, BLOCK, max_model_len=4 * BLOCK, max_batch=8)
    if DEVICE == "cuda":
        graphs.capture()
    g = torch.Generator().manual_seed(num_decodes)
    # sequences of 5..40 cached tokens in scattered blocks; one new token each
    lens = [5 + 7 * i for i in range(num_decodes)]
    ids = torch.randint(0, 2000, (num_decodes,), generator=g).tolist()
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = [[free.pop() for _ in range(n // BLOCK + 1)] for n in lens]
    slots = [t[n // BLOCK] * BLOCK + n % BLOCK for t, n in zip(tables, lens)]
    before = cache.clone()

    meta = AttentionMetadata.build(list(zip(lens, tables)), [], BLOCK).to(DEVICE)
    eager = model(torch.tensor(ids, device=DEVICE), torch.tensor(lens, device=DEVICE), layers,
                  meta).clone()
    eager_cache = cache.clone()
    cache.copy_(before)
    padded = graphs.run(ids, list(zip(lens, tables)))
    assert padded.shape == eager.shape
    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
    # the real rows' keys and values landed, and the padding rows wrote nothing
    torch.testing.assert_close(cache, eager_cache, rtol=1e-5, atol=1e-5)
    changed = (cache != before).flatten(4).any(-1).any(0).any(0)  # [blocks, block_size]
    assert sorted(changed.nonzero().tolist()) == sorted([s // BLOCK, s % BLOCK] for s in slots)
    assert graphs.replays == (1 if DEVICE == "cuda" else 0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_worker_on_graphs_samples_what_an_eager_one_does(tiny_llama, dtype):
    from common.plans import NewRequest, ScheduledTokens, StepPlan
    from common.sampling_params import SamplingParams
    from common.worker.config import WorkerConfig
    from common.worker.service import build_worker

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 2000, (3 + 11 * i,), generator=g).tolist() for i in range(9)]
    runs = []
    for eager in (True, False):
        w, _ = build_worker(WorkerConfig(
            role="decode", model=str(tiny_llama), worker_id=f"graphs-{uuid.uuid4().hex[:6]}",
            num_kv_blocks=96, device="cuda", dtype=dtype, enforce_eager=eager,
            max_cudagraph_capture_size=8))
        tokens = {f"r{i}": [] for i in range(len(prompts))}
        step = 0
        # 1, then 3, then 9 requests decode together: buckets 1, 4 and (past 8) eager
        for joined in (1, 3, 9):
            plan = StepPlan(step)
            for i in range(joined):
                rid = f"r{i}"
                if tokens[rid]:
                    continue
                plan.new_requests.append(NewRequest(
                    rid, tuple(prompts[i]), len(prompts[i]), 0, tuple(range(10 * i, 10 * i + 10)),
                    SamplingParams(max_tokens=64)))
                plan.scheduled.append(ScheduledTokens(rid, len(prompts[i])))
            for s in w.execute(plan).sampled:
                tokens[s.request_id].append(s.token_id)
            for _ in range(6):
                step += 1
                plan = StepPlan(step, scheduled=[ScheduledTokens(f"r{i}", 1)
                                                 for i in range(joined)])
                for s in w.execute(plan).sampled:
                    tokens[s.request_id].append(s.token_id)
            step += 1
        graphs = w.runner.decode_graphs
        assert (graphs is None) == eager
        if graphs is not None:
            assert graphs.replays == 12  # the 1- and 3-request decode steps; 9 > 8 ran eagerly
        runs.append(tokens)
        w.close()
    assert runs[0] == runs[1]
