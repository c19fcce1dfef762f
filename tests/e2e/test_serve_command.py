"""`pdserve serve MODEL` with vLLM's flags starts the four services, each flag on the command line
of the service that owns it, and they take effect: the served name, the API key, the sampling
defaults of a generation config directory (greedy, 5 tokens: transformers' greedy tokens), no
prefix caching."""
import json

import httpx
import pytest
import torch
import transformers

from tests.e2e.conftest import Stack

KEY = "sk-e2e"
DEFAULT_MAX_TOKENS = 5
SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
BIAS = {5: 30.0, 17: 30.0, 300: 30.0, 1200: 30.0}  # outputs of few tokens: drafts come right


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    recommends = tmp / "generation"
    recommends.mkdir()
    (recommends / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": DEFAULT_MAX_TOKENS}))
    s = Stack(tiny_llama, tmp, "--served-model-name", "tiny-served", "--api-key", KEY,
              "--generation-config", str(recommends), "--seed", "3", "--max-model-len", "512",
              "--max-num-seqs", "4", "--no-enable-prefix-caching", "--block-size", "16",
              "--num-kv-blocks", "64", "--speculative-config", SPECULATIVE, command="serve")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def test_each_flag_is_on_its_services_command_line(stack):
    argv = {c.split("pdserve ", 1)[1].split()[0]: f" {c} " for c in stack.children().values()
            if "pdserve " in c}
    assert sorted(argv) == ["decode-worker", "gateway", "prefill-worker", "scheduler"]
    for worker in ("prefill-worker", "decode-worker"):
        for flag in ("--dtype float32", "--seed 3", "--max-model-len 512", "--block-size 16"):
            assert f" {flag} " in argv[worker], (flag, argv[worker])
    for flag in ("--no-enable-prefix-caching", "--max-num-seqs 4", "--max-model-len 512"):
        assert f" {flag} " in argv["scheduler"]
    for flag in ("--served-model-name tiny-served", f"--api-key {KEY}", "--max-model-len 512"):
        assert f" {flag} " in argv["gateway"]
    assert f" --speculative-config {SPECULATIVE} " in argv["decode-worker"]
    assert "--speculative-config" not in argv["prefill-worker"]


def test_the_stack_answers_under_its_name_key_and_defaults(stack, hf):
    prompt = torch.randint(0, 2000, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        assert client.get("/v1/models").status_code == 401
        assert [m["id"] for m in client.get("/v1/models", headers=auth).json()["data"]] == \
            ["tiny-served"]
        body = {"model": "tiny-served", "prompt": prompt, "ignore_eos": True,
                "return_token_ids": True}  # no temperature, no max_tokens: the config's
        first, again = (client.post("/v1/completions", json=body, headers=auth)
                        for _ in range(2))
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=DEFAULT_MAX_TOKENS,
                       min_new_tokens=DEFAULT_MAX_TOKENS, do_sample=False)[0, len(prompt):]
    for r in (first, again):
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["model"] == "tiny-served"
        assert out["choices"][0]["token_ids"] == want.tolist()
        assert out["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS
        # the same 40-token prompt twice, and nothing cached: prefix caching is off
        assert (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0


def test_speculative_decoding_keeps_greedy_tokens_and_counts_what_it_accepted(stack, hf):
    prompt = torch.randint(0, 2000, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    body = {"model": "tiny-served", "prompt": prompt, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "logit_bias": BIAS}
    with httpx.Client(base_url=stack.url, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as client:
        r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40,
                       do_sample=False, sequence_bias={(t,): b for t, b in BIAS.items()})
    assert r.json()["choices"][0]["token_ids"] == want[0, len(prompt):].tolist()
    (decode,) = [w for w in stack.wait_idle()["workers"] if w["role"] == "decode"]
    assert decode["num_speculative_tokens"] == 3
    accepted = int(decode["spec_decode_num_accepted_tokens"])
    assert 0 < accepted <= int(decode["spec_decode_num_draft_tokens"])
    assert sum(map(int, decode["spec_decode_num_accepted_tokens_per_pos"])) == accepted


def test_a_stop_string_inside_a_step_of_accepted_drafts_cuts_the_text_there(stack):
    """Outputs held to four tokens come in steps of several; a stop string taken from the
    middle of one run ends the text just before it, whole and streamed."""
    prompt = torch.randint(0, 2000, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    body = {"model": "tiny-served", "prompt": prompt, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "logit_bias": BIAS}
    with httpx.Client(base_url=stack.url, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as client:
        full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stop = full[len(full) // 2:len(full) // 2 + 3]
        cut = full[:full.index(stop)]
        whole = client.post("/v1/completions", json={**body, "stop": [stop]}).json()
        assert whole["choices"][0]["text"] == cut
        assert whole["choices"][0]["finish_reason"] == "stop"
        with client.stream("POST", "/v1/completions",
                           json={**body, "stop": [stop], "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == cut
