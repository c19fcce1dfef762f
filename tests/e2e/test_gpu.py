"""The four processes with GPU workers (needs a CUDA host; skipped otherwise): greedy tokens
equal transformers' for every KV transport a GPU pair can use. cuda_ipc and tcp run with both
workers on one GPU; nccl needs two (NCCL refuses two ranks on one device)."""
import pytest
import torch
import transformers

from tests.e2e.conftest import Stack

pytestmark = pytest.mark.cuda

PROMPTS = [[(7 * i + 3 * k) % 2000 for k in range(n)] for i, n in enumerate((1, 17, 123))]


@pytest.mark.parametrize("transport", ["cuda_ipc", "tcp", "nccl"])
def test_gpu_workers_match_hf(tiny_llama, tmp_path, transport):
    devices = ("cuda:0", "cuda:0")
    if transport == "nccl":
        if torch.cuda.device_count() < 2:
            pytest.skip("nccl between two workers needs two GPUs")
        devices = ("cuda:0", "cuda:1")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    args = f"--kv-transports {transport} --gpu-memory-utilization 0.2"
    s = Stack(tiny_llama, tmp_path, "--device", "cuda",
              "--prefill-worker-args", f"{args} --device {devices[0]}",
              "--decode-worker-args", f"{args} --device {devices[1]}")
    try:
        import httpx
        with httpx.Client(base_url=s.url, timeout=120) as c:
            name = c.get("/v1/models").json()["data"][0]["id"]
            for prompt in PROMPTS:
                r = c.post("/v1/completions", json={
                    "model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True})
                assert r.status_code == 200, r.text
                want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                                   do_sample=False)[0, len(prompt):].tolist()
                assert r.json()["choices"][0]["token_ids"] == want
        stats = s.wait_idle()
        workers = {w["role"]: w for w in stats["workers"]}
        assert workers["decode"]["kv_blocks_received"] > 0  # the disaggregated path ran
        assert all(w["num_free_blocks"] == w["num_blocks"] for w in stats["workers"])
    finally:
        s.stop()
