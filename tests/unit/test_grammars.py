"""Structured outputs on a worker (common/worker/grammars.py through build_worker's Worker):
greedy tokens under a grammar equal HuggingFace's argmax over the tokens an independent xgrammar
matcher allows at each step, on the same weights, until an eos; a request that arrives with
output tokens (prefill -> decode, a recompute) replays them and goes on as an undisturbed run;
forks sample their first token under their leader's grammar; a grammar that does not compile or
outputs that left it fail that request alone; mask_logits sets exactly the disallowed tokens of
guided rows to -inf.

The grammars are EBNF texts as the gateway makes them (xgrammar's from_regex, from_json_schema
without free whitespace: a random-weight model fills a budget with it), made here with xgrammar.
"""
import itertools
import json
import re
import uuid

import jsonschema
import pytest
import torch
import transformers
import xgrammar as xgr

from common.plans import Fork, NewRequest, ScheduledTokens, StepPlan, StepResult
from common.sampling_params import SamplingParams
from common.worker.config import WorkerConfig
from common.worker.grammars import Grammars, Guide, mask_logits
from common.worker.service import build_worker

VOCAB = 2048
BLOCKS_PER_REQUEST = 8  # 128 tokens: a prompt and any output these grammars allow
MAX_TOKENS = 100

REGEX = r"[a-z]{1,6}(-[a-z]{1,4}){0,2}: [0-9]{1,3}"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}
GRAMMARS = {
    "regex": str(xgr.Grammar.from_regex(REGEX)),
    "json": str(xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False)),
}
DIGITS = str(xgr.Grammar.from_regex(r"[0-9]{3}"))
STEP_IDS = itertools.count(1)


@pytest.fixture(scope="module")
def eos(tiny_llama) -> tuple[int, ...]:
    """The model's eos ids (generation_config.json), as the gateway sends them."""
    ids = json.loads((tiny_llama / "generation_config.json").read_text())["eos_token_id"]
    return tuple(ids)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return transformers.AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> xgr.GrammarCompiler:
    """The test's own: its matchers say what each step may sample, apart from the worker's."""
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB))


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def worker(tiny_llama):
    w, _ = build_worker(WorkerConfig(
        role="decode", model=str(tiny_llama), worker_id=f"grammars-{uuid.uuid4().hex[:6]}",
        num_kv_blocks=8 * BLOCKS_PER_REQUEST, dtype="float32", kv_transports=("shm",)))
    yield w
    w.close()


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed))
                 .tolist())


def _blocks(slot: int) -> tuple[int, ...]:
    return tuple(range(slot * BLOCKS_PER_REQUEST, (slot + 1) * BLOCKS_PER_REQUEST))


def _new(rid, prompt, slot, eos, grammar="", output=(), computed=0, forks=(), **sampling):
    params = SamplingParams(max_tokens=MAX_TOKENS, grammar=grammar, **sampling)
    return NewRequest(rid, tuple(prompt) + tuple(output), len(prompt), computed, _blocks(slot),
                      params, eos, forks=forks)


def _step(worker, new=(), scheduled=(), finished=()) -> StepResult:
    return worker.execute(StepPlan(
        next(STEP_IDS), new_requests=list(new),
        scheduled=[ScheduledTokens(rid, n) for rid, n in scheduled],
        finished_request_ids=list(finished)))


def _generate(worker, new: NewRequest) -> list[int]:
    """Runs `new` alone until it samples an eos (or MAX_TOKENS in all): its output tokens, those
    it came with included."""
    result = _step(worker, [new], [(new.request_id, len(new.all_token_ids)
                                    - new.num_computed_tokens)])
    tokens = list(new.all_token_ids[new.num_prompt_tokens:])
    while True:
        assert result.errors == (), result.errors
        (sampled,) = result.sampled
        tokens.append(sampled.token_id)
        if sampled.token_id in new.eos_token_ids or len(tokens) == MAX_TOKENS:
            break
        result = _step(worker, scheduled=[(new.request_id, 1)])
    _step(worker, finished=[new.request_id])
    return tokens


def _allowed(matcher: xgr.GrammarMatcher) -> list[int]:
    """The tokens the matcher accepts next, each tried and taken back."""
    allowed = []
    for token in range(VOCAB):
        if matcher.accept_token(token):
            allowed.append(token)
            matcher.rollback(1)
    return allowed


def _matcher(compiler, grammar: str, eos, output=()) -> xgr.GrammarMatcher:
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar), override_stop_tokens=list(eos))
    for token in output:
        assert matcher.accept_token(token), token
    return matcher


def _hf_guided_greedy(hf, compiler, grammar, prompt, eos) -> tuple[list[int], int]:
    """transformers' logits, argmax over what the matcher allows, until it takes an eos; and
    at how many steps that is not the argmax over all tokens."""
    matcher = _matcher(compiler, grammar, eos)
    tokens: list[int] = []
    steered = 0
    while not matcher.is_terminated() and len(tokens) < MAX_TOKENS:
        with torch.no_grad():
            logits = hf(torch.tensor([list(prompt) + tokens])).logits[0, -1]
        allowed = torch.tensor(_allowed(matcher))
        token = allowed[logits[allowed].argmax()].item()
        steered += token != logits.argmax().item()
        assert matcher.accept_token(token)
        tokens.append(token)
    return tokens, steered


def _check_text(kind: str, text: str) -> None:
    if kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("kind", ["regex", "json"])
def test_greedy_under_a_grammar_matches_hf_restricted_to_what_it_allows(
        worker, hf, compiler, tokenizer, eos, kind):
    prompt = _prompt(19, 1)
    tokens = _generate(worker, _new("g", prompt, 0, eos, GRAMMARS[kind]))
    want, steered = _hf_guided_greedy(hf, compiler, GRAMMARS[kind], prompt, eos)
    assert tokens == want
    assert steered > 0  # the grammar, not the model alone, chose some of them
    assert tokens[-1] in eos and len(tokens) > 3
    _check_text(kind, tokenizer.decode(tokens[:-1]))


@pytest.mark.parametrize("kind", ["regex", "json"])
def test_a_request_with_output_tokens_goes_on_where_they_left_its_grammar(
        worker, eos, kind):
    grammar = GRAMMARS[kind]
    prompt = _prompt(21, 2)
    whole = _generate(worker, _new("whole", prompt, 0, eos, grammar))
    assert len(whole) > 4

    # prefill -> decode: one worker samples the first token, another gets the prompt's KV
    # (here: the same blocks) and the request with that token as its output
    first = _step(worker, [_new("p", prompt, 1, eos, grammar)], [("p", len(prompt))])
    _step(worker, finished=["p"])
    assert [s.token_id for s in first.sampled] == whole[:1]
    decoded = _generate(worker, _new("d", prompt, 1, eos, grammar, output=whole[:1],
                                     computed=len(prompt)))
    assert decoded == whole

    # a recompute (after a preemption, or on another worker): prompt and outputs from scratch
    k = len(whole) // 2
    assert _generate(worker, _new("r", prompt, 2, eos, grammar, output=whole[:k])) == whole


def test_forks_sample_their_first_token_under_the_grammar(worker, compiler, eos):
    prompt = _prompt(17, 3)
    digits = set(_allowed(_matcher(compiler, DIGITS, eos)))
    assert len(digits) == 10

    def first_tokens(grammar: str) -> list[int]:
        forks = tuple(Fork(f"f/{j}", SamplingParams(max_tokens=4, temperature=1.5, seed=j,
                                                    grammar=grammar)) for j in range(1, 8))
        result = _step(worker, [_new("f", prompt, 0, eos, grammar, forks=forks,
                                     temperature=1.5, seed=0)], [("f", len(prompt))])
        _step(worker, finished=["f"])
        assert result.errors == ()
        assert [s.request_id for s in result.sampled] == ["f", *(f.request_id for f in forks)]
        return [s.token_id for s in result.sampled]

    assert set(first_tokens(DIGITS)) <= digits
    assert not set(first_tokens("")) <= digits  # the same seeds, unguided: the mask did it


def test_a_grammar_that_fails_fails_only_its_request(worker, hf, compiler, eos, tokenizer):
    prompt = _prompt(15, 4)
    with torch.no_grad():
        greedy = hf(torch.tensor([prompt])).logits[0, -1].argmax().item()
    letter = tokenizer.encode("x")
    assert len(letter) == 1 and letter[0] not in _allowed(_matcher(compiler, DIGITS, eos))
    result = _step(worker, [
        _new("broken", prompt, 0, eos, "root ::= ("),  # no EBNF: the gateway would refuse it
        _new("ok", prompt, 1, eos),
        _new("left", prompt, 2, eos, DIGITS, output=letter),  # its output is no number
        _new("guided", prompt, 3, eos, DIGITS),
    ], [("broken", len(prompt)), ("ok", len(prompt)), ("left", len(prompt) + 1),
        ("guided", len(prompt))])
    errors = {e.request_id: e.error for e in result.errors}
    assert set(errors) == {"broken", "left"}
    assert "does not compile" in errors["broken"] and "does not match" in errors["left"]
    sampled = {s.request_id: s.token_id for s in result.sampled}
    assert set(sampled) == {"ok", "guided"}
    assert sampled["ok"] == greedy
    assert sampled["guided"] in _allowed(_matcher(compiler, DIGITS, eos))
    # and the worker goes on with the others
    after = _step(worker, scheduled=[("ok", 1), ("guided", 1)],
                  finished=["broken", "left"])
    assert after.errors == () and {s.request_id for s in after.sampled} == {"ok", "guided"}
    _step(worker, finished=["ok", "guided"])


def test_mask_logits_sets_exactly_the_disallowed_tokens_to_minus_inf(
        tiny_llama, compiler, tokenizer, eos):
    grammars = Grammars(tiny_llama, VOCAB)
    opened = tokenizer.encode('{"name": "')
    done = tokenizer.encode("123") + [eos[0]]

    def guide(grammar: str, output: list[int]) -> Guide:
        g = Guide(grammars.matcher(grammar, list(eos)))
        g.follow(output)
        return g

    guides = [None, guide(DIGITS, []), None, guide(GRAMMARS["json"], opened),
              guide(DIGITS, done)]
    assert not guides[4].constrains  # it took an eos: what follows is free
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(5))
    before = logits.clone()
    mask_logits(logits, guides, VOCAB)
    for row in (0, 2, 4):
        assert torch.equal(logits[row], before[row]), row
    for row, grammar, output in ((1, DIGITS, []), (3, GRAMMARS["json"], opened)):
        allowed = torch.tensor(_allowed(_matcher(compiler, grammar, eos, output)))
        want = torch.full((VOCAB,), float("-inf"))
        want[allowed] = before[row, allowed]
        assert torch.equal(logits[row], want), row
        assert 0 < len(allowed) < VOCAB
