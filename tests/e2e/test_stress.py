"""A bounded storm through the four processes with a KV pool small enough to preempt: shared
prefixes, streams cut off mid-way, n=2, seeded sampling, stop tokens, all at once. Nothing
errors, every greedy answer equals HuggingFace's, and every block comes back."""
import asyncio
import random

import httpx
import pytest
import torch
import transformers

from tests.e2e.conftest import Stack
from tests.e2e.test_serve import _greedy

NUM_REQUESTS = 40


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def test_storm_of_mixed_requests(tiny_llama, tmp_path, hf):
    rng = random.Random(7)
    system = [rng.randrange(2000) for _ in range(48)]
    plans = []
    for i in range(NUM_REQUESTS):
        shared = rng.random() < 0.5
        prompt = (system if shared else []) + [rng.randrange(2000) for _ in range(rng.randint(1, 40))]
        kind = rng.choice(["greedy", "greedy", "seeded", "cut", "n2", "stop"])
        plans.append((i, kind, prompt, rng.randint(4, 24)))
    stack = Stack(tiny_llama, tmp_path, "--num-kv-blocks", "24", "--max-num-batched-tokens", "64")
    try:
        results = asyncio.run(_storm(stack.url, plans))
        for (i, kind, prompt, max_tokens), out in zip(plans, results):
            if kind == "cut":
                continue  # the client left; nothing to compare
            assert out["status"] == 200, (i, kind, out)
            if kind == "greedy":
                assert out["choices"][0]["token_ids"] == _greedy(hf, prompt, max_tokens), i
            if kind == "n2":
                assert len(out["choices"]) == 2
        stats = stack.wait_idle(timeout=60)
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert stats["num_preemptions"] > 0  # the pool really was too small
        assert all(w["num_free_blocks"] == w["num_blocks"] for w in stats["workers"])
    finally:
        stack.stop()


async def _storm(url, plans):
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        name = (await c.get("/v1/models")).json()["data"][0]["id"]
        return await asyncio.gather(*[_one(c, name, *p) for p in plans])


async def _one(c, name, i, kind, prompt, max_tokens):
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    if kind == "seeded":
        body.update(temperature=0.8, top_p=0.9, seed=i)
    if kind == "n2":
        body.update(n=2, temperature=1.0, seed=i)
    if kind == "stop":
        body.update(stop_token_ids=[prompt[0]], ignore_eos=False)
    if kind == "cut":
        body.update(stream=True, max_tokens=200)
        async with c.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break  # the client goes away mid-stream
        return {"status": r.status_code}
    r = await c.post("/v1/completions", json=body)
    return {"status": r.status_code, **(r.json() if r.status_code == 200 else {"body": r.text})}
