"""The load client the benchmarks share: named workloads, Poisson arrivals, one streaming
OpenAI request per prompt (completions for token prompts, chat completions for conversations)
against any compatible server (pdserve or a baseline such as vLLM, with the same code),
per-request timings, and their summary.

Every request streams with ignore_eos (greedy unless the caller sets a temperature), so each
server produces exactly max_tokens tokens. TTFT is the time to the first non-empty token chunk,
TPOT the mean gap between a request's later tokens, ITL every single gap; goodput counts the
requests per second that met both the TTFT and the TPOT objective.
"""
from __future__ import annotations

import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from common.ports import free_ports

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 2000  # prompt token ids are drawn below this: valid for every model here
CORPUS = ROOT / "common" / "models" / "tiny_corpus.txt"  # real English prose, in sections

Message = dict[str, str]
Prompt = list[int] | list[Message]  # token ids, or a conversation for a chat model


def workload(name: str, n: int, seed: int) -> list[Prompt]:
    """random:        256-token prompts (the throughput workload)
    bimodal:       80% of prompts 50-200 tokens, 20% 2000-3800 (the disaggregation lesson's)
    mixed:         90% 50-200, 10% 2000-3000
    shared-prefix: one 1024-token system prompt and a 20-80-token question each
    multi-turn:    conversations taking turns (multi_turn): each turn's prompt is the one
                   before, an answer and a new question, so it shares a growing prefix
    chat:          real text for a chat model (chat_conversations)
    idle:          prompts of IDLE_LENGTHS tokens in turn, for one request at a time"""
    rng = random.Random(seed)

    def tokens(k: int) -> list[int]:
        return [rng.randrange(0, VOCAB) for _ in range(k)]

    if name == "random":
        return [tokens(256) for _ in range(n)]
    if name == "idle":
        return [tokens(IDLE_LENGTHS[i % len(IDLE_LENGTHS)]) for i in range(n)]
    if name == "shared-prefix":
        return shared_prefix(n, 1024, (20, 80), seed)
    if name == "multi-turn":
        return multi_turn(n, MULTI_TURN_CONVERSATIONS, seed)
    if name == "chat":
        return chat_conversations(n, seed)
    long_frac, long = LONG_PROMPTS[name]
    return [tokens(rng.randint(*long) if rng.random() < long_frac else rng.randint(50, 200))
            for _ in range(n)]


def shared_prefix(n: int, system_len: int, question: tuple[int, int],
                  seed: int) -> list[list[int]]:
    """One system prompt of system_len tokens, then a question of `question` tokens each."""
    rng = random.Random(seed)
    system = [rng.randrange(0, VOCAB) for _ in range(system_len)]
    return [system + [rng.randrange(0, VOCAB) for _ in range(rng.randint(*question))]
            for _ in range(n)]


MULTI_TURN_CONVERSATIONS = 16


def multi_turn(n: int, conversations: int, seed: int) -> list[list[int]]:
    """n prompts of `conversations` conversations taking turns in order (each one's next turn
    after every other's): a conversation opens with a document of 300-600 tokens and a question
    of 30-80, and each later turn is its previous prompt, an answer of 64 tokens and a new
    question. Between two turns of one conversation every other one takes a turn, so a KV cache
    smaller than all of them together has evicted its prefix by then."""
    rng = random.Random(seed)

    def tokens(k: int) -> list[int]:
        return [rng.randrange(0, VOCAB) for _ in range(k)]

    history = [tokens(rng.randint(300, 600)) + tokens(rng.randint(30, 80))
               for _ in range(conversations)]
    out = []
    for i in range(n):
        c = i % conversations
        if i >= conversations:
            history[c] = history[c] + tokens(64) + tokens(rng.randint(30, 80))
        out.append(list(history[c]))
    return out


SYSTEM_PROMPT = (
    "You are a helpful assistant for a small engineering team. Answer in plain English, "
    "briefly and accurately. When a question is about a text the user gives you, answer from "
    "that text alone and say so when it does not hold the answer. When a question asks for a "
    "list, give at most five items. Never invent numbers, names or quotations; if you are not "
    "sure, say that you are not sure. Prefer short sentences, and explain any technical word "
    "the first time you use it.")
QUESTIONS = (
    "What is the capital of France?",
    "Give me three tips for baking bread at home.",
    "Explain what a cache is in one paragraph.",
    "Why does a server need a queue?",
    "What should I pack for a day trip to the sea?",
    "How do I make a simple vegetable soup?",
    "What is the difference between weather and climate?",
    "Write a haiku about a lighthouse.",
    "How many minutes are there in a day?",
    "What does a tokenizer do?",
    "Name three things that make a good team meeting.",
    "Why is the sky blue?",
)
ABOUT_TEXT = ("Summarize this text in two sentences:", "What is the main point of this text?",
              "List the people or places this text mentions.",
              "Write a title for this text.")
FOLLOW_UPS = ("Can you say that more simply?", "Give me one example.",
              "Why does that matter?", "Thanks. What should I read next about it?")


def chat_conversations(n: int, seed: int, follow_up: float = 0.3) -> list[list[Message]]:
    """n conversations of real text, each opened by the one shared SYSTEM_PROMPT (about 100
    tokens). New ones ask a short question (60%), ask about one paragraph of the corpus (25%,
    150-350 tokens in all) or about 2-5 of its sections in a row (15%, a long prompt of about
    600-2000 tokens). A `follow_up` share instead continues an earlier
    conversation: its messages, the assistant's answer to them (corpus text) and a follow-up
    question, so that a chat's turns share their growing prefix as they do in a real client."""
    rng = random.Random(seed)
    sections = _corpus_sections()
    paragraphs = [p for s in sections for p in s.split("\n\n")]
    out: list[list[Message]] = []
    for _ in range(n):
        if out and rng.random() < follow_up:
            earlier = rng.choice(out)
            answer = " ".join(rng.choice(paragraphs).split(". ")[:2]).rstrip(".") + "."
            out.append(earlier + [{"role": "assistant", "content": answer},
                                  {"role": "user", "content": rng.choice(FOLLOW_UPS)}])
            continue
        kind = rng.random()
        if kind < 0.6:
            question = rng.choice(QUESTIONS)
        elif kind < 0.85:
            question = f"{rng.choice(ABOUT_TEXT)}\n\n{rng.choice(paragraphs)}"
        else:
            first, count = rng.randrange(len(sections)), rng.randint(2, 5)
            text = "\n\n".join((sections * 2)[first:first + count])
            question = f"{rng.choice(ABOUT_TEXT)}\n\n{text}"
        out.append([{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": question}])
    return out


def _corpus_sections() -> list[str]:
    """The corpus's sections (paragraphs under one title line), without their titles."""
    sections: list[list[str]] = []
    for block in CORPUS.read_text(encoding="utf-8").split("\n\n"):
        block = block.strip()
        if "\n" not in block and len(block) < 80 and not block.endswith((".", "?", "!", '"')):
            sections.append([])  # a title
        elif block:
            sections[-1].append(block)
    return ["\n\n".join(s) for s in sections if s]


# workloads of short and long prompts: the share of long ones and their lengths (short: 50-200)
LONG_PROMPTS = {"bimodal": (0.2, (2000, 3800)), "mixed": (0.1, (2000, 3000))}
WORKLOADS = ("random", "bimodal", "mixed", "shared-prefix", "multi-turn", "chat", "idle")
IDLE_LENGTHS = (128, 1024, 3000)  # an idle server's TTFT at each of these prompt lengths


@dataclass
class Record:
    """One request as the client saw it; times in seconds from the run's start."""
    prompt_tokens: int
    start: float
    first: float = float("nan")   # first token
    end: float = float("nan")     # last token
    gaps: list[float] = field(default_factory=list)  # between consecutive tokens
    tokens: int = 0
    error: str = ""
    id: str = ""                  # the server's id of the response
    sent_unix: float = float("nan")  # `start` in wall-clock time (spans.attach)
    phases: list = field(default_factory=list)  # its spans in the server (spans.phases)
    hold: list = field(default_factory=list)  # the scheduler's price of a hold (spans.hold_terms)

    @property
    def ttft(self) -> float:
        return self.first - self.start

    @property
    def tpot(self) -> float:
        return statistics.mean(self.gaps) if self.gaps else float("nan")


async def _one(client: httpx.AsyncClient, model: str, prompt: Prompt, max_tokens: int,
               t0: float, extra: dict | None = None) -> Record:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, **(extra or {})}
    if prompt and isinstance(prompt[0], dict):  # a conversation: the server's chat template
        path, body["messages"] = "/v1/chat/completions", prompt
        body["stream_options"] = {"include_usage": True}  # its length in tokens
        rec = Record(0, time.perf_counter() - t0)
    else:
        path, body["prompt"] = "/v1/completions", prompt
        rec = Record(len(prompt), time.perf_counter() - t0)
    rec.sent_unix = time.time()
    times: list[float] = []
    try:
        async with client.stream("POST", path, json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                rec.id = rec.id or chunk.get("id", "")
                if chunk.get("usage") and not rec.prompt_tokens:
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                for c in chunk.get("choices", []):
                    # servers that do not return token ids stream one token per chunk
                    text = c.get("text") or (c.get("delta") or {}).get("content")
                    n = len(c.get("token_ids") or []) or int(bool(text))
                    times += [time.perf_counter() - t0] * n
    except httpx.HTTPError as e:
        rec.error = repr(e)
    if times:
        rec.first, rec.end, rec.tokens = times[0], times[-1], len(times)
        rec.gaps = [b - a for a, b in zip(times, times[1:])]
    return rec


async def run_load(url: str, prompts: list[Prompt], rate: float, max_tokens: int,
                   seed: int, label: str = "", extra: dict | None = None,
                   concurrency: int = 0) -> tuple[list[Record], float]:
    """Sends the prompts at `rate` requests/s (Poisson; 0: all at once; -1: one at a time,
    each after the one before has ended) after one warm-up request, at most `concurrency` in
    flight (0: no bound), each body with `extra`'s fields; returns their records and the wall
    time until the last one ended. A progress bar named `label` counts finished requests on a
    terminal."""
    rng = random.Random(seed)
    with tqdm(total=len(prompts), desc=label or url, unit="req", disable=None,
              leave=False) as bar:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            await _one(client, model, prompts[0][:16], 2, time.perf_counter())
            gate = asyncio.Semaphore(concurrency or len(prompts))

            async def one(p: Prompt) -> Record:
                async with gate:
                    return await _one(client, model, p, max_tokens, t0, extra)

            t0 = time.perf_counter()
            tasks = []
            for p in prompts:
                tasks.append(asyncio.create_task(one(p)))
                tasks[-1].add_done_callback(lambda _: bar.update())
                if rate < 0:
                    await tasks[-1]
                elif rate > 0:
                    await asyncio.sleep(rng.expovariate(rate))
            records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile in milliseconds (nearest rank); nan for no values."""
    xs = sorted(x for x in xs if x == x)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] * 1000 if xs else float("nan")


def summarize(records: list[Record], wall: float, slo_ttft_s: float,
              slo_tpot_s: float, long_from: int = 0) -> dict[str, float]:
    """The run's figures; with `long_from`, the mean TTFT of prompts of at least that many
    tokens and of the others too (over ~12 long prompts the p99 is the slowest one's, while
    their mean moves less from one run to the next)."""
    ok = [r for r in records if not r.error and r.tokens]
    good = [r for r in ok if r.ttft <= slo_ttft_s and (not r.gaps or r.tpot <= slo_tpot_s)]
    out = {"requests": len(records), "failed": len(records) - len(ok),
           "out tok/s": sum(r.tokens for r in ok) / wall,
           "TTFT p50": pct([r.ttft for r in ok], 50), "TTFT p99": pct([r.ttft for r in ok], 99),
           "TPOT p50": pct([r.tpot for r in ok], 50), "TPOT p99": pct([r.tpot for r in ok], 99),
           "ITL p99": pct([g for r in ok for g in r.gaps], 99),
           "goodput req/s": len(good) / wall}
    if long_from:
        for key, part in (("long", [r.ttft for r in ok if r.prompt_tokens >= long_from]),
                          ("short", [r.ttft for r in ok if r.prompt_tokens < long_from])):
            out[f"TTFT mean {key}"] = statistics.mean(part) * 1000 if part else float("nan")
    return out


def ttft_by_length(records: list[Record]) -> dict[int, float]:
    """Median TTFT in milliseconds per prompt length."""
    by: dict[int, list[float]] = {}
    for r in records:
        if not r.error and r.tokens:
            by.setdefault(r.prompt_tokens, []).append(r.ttft)
    return {n: statistics.median(ts) * 1000 for n, ts in sorted(by.items())}


def records_json(records: list[Record]) -> list[dict]:
    return [{**asdict(r), "ttft": r.ttft, "tpot": r.tpot} for r in records]


def launch(model: str, up_args: list[str], log: Path) -> tuple[subprocess.Popen, str, str]:
    """`pdserve up` on free ports: (process, gateway url, scheduler address)."""
    port, sport = free_ports(2)
    proc = subprocess.Popen([str(Path(sys.executable).parent / "pdserve"), "up", "--model", model,
                             "--port", str(port), "--scheduler-port", str(sport), *up_args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 300
    while "pdserve is up" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(log.read_text()[-3000:])
        time.sleep(0.3)
    return proc, f"http://127.0.0.1:{port}", f"127.0.0.1:{sport}"


def stop(procs: list[subprocess.Popen]) -> None:
    """Ends stacks `launch` started: SIGINT to each (`pdserve up` stops its services), then
    waits for them."""
    for proc in procs:
        proc.send_signal(signal.SIGINT)
    for proc in procs:
        proc.wait(60)
