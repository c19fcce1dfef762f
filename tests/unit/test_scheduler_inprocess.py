"""The scheduler driving real workers in this process (no gRPC): tokens equal HuggingFace's
greedy ones, and every block comes back through finishes, aborts, preemptions and lost workers.
KV moves over the real transports (shm by default, tcp on loopback where a test asks)."""
import asyncio
import collections
import itertools
import os
import threading
from dataclasses import replace

import pytest
import torch
import transformers

from common.worker.config import WorkerConfig
from common.worker.service import build_worker, start_listeners
from common.sampling_params import SamplingParams
from services.scheduler.block_hash import extend_block_hashes
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import RegistrationError, Scheduler


_CLUSTERS = itertools.count()  # worker ids unique in this process, whatever a test leaves open


class Cluster:
    def __init__(self, model_dir, roles_blocks, worker_kw=None, **sched_kw):
        # a clock that stands still: no prefill speed is measured, so where a prompt goes does
        # not depend on how fast this machine runs the steps (tests/policy times them)
        self.sched = Scheduler(SchedulerConfig(**sched_kw), clock=lambda: 0.0)
        self.workers = {}
        self.built = []  # every worker made, lost ones too: close() ends them all
        self.threads = torch.get_num_threads()  # plans of workers sharing cores change it
        self.loop = asyncio.new_event_loop()  # the workers' listeners run here
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        for i, (role, blocks) in enumerate(roles_blocks):
            # float32, as the references are, whatever --dtype auto would pick on this host
            kw = {"kv_transports": ("shm",), "dtype": "float32", **(worker_kw or {})}
            worker, reg = build_worker(WorkerConfig(
                role=role, model=str(model_dir), worker_id=f"test-{role}-{i}-c{next(_CLUSTERS)}",
                num_kv_blocks=blocks, block_size=4, **kw))
            self._await(start_listeners(worker, reg))
            self.registrations = getattr(self, "registrations", []) + [reg]
            self.sched.add_worker(reg)
            self.workers[reg.worker_id] = worker
            self.built.append(worker)
        self.outputs = {}
        self.hold_sends = False  # keep KV sends back, as a slow transport would
        self.sent = {}  # worker id -> plans sent, not yet run
        self.ahead_plans = 0
        self.held = []

    def deliver(self):
        for wid, sends in self.held:
            if wid in self.workers:
                self.sched.transfers_done(wid, self.workers[wid].send_kv(sends))
        self.held.clear()

    def _await(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def extra_worker(self, **cfg):
        """A worker built beside the cluster's, not registered: the test decides what to do
        with its registration. close() ends it."""
        worker, reg = build_worker(WorkerConfig(
            worker_id=f"test-extra-c{next(_CLUSTERS)}", num_kv_blocks=4, block_size=4, **cfg))
        self.built.append(worker)
        return worker, reg

    def lose(self, wid):
        """The worker is gone for the scheduler's driving; its cache is closed (its shm KV
        unmapped) as a dead process's would be. close() ends the rest of it."""
        self.workers.pop(wid).cache.close()

    def close(self):
        for w in self.built:
            w.close()
            for listener in w.listeners.values():
                self._await(listener.close())
        torch.set_num_threads(self.threads)
        self.loop.call_soon_threadsafe(self.loop.stop)

    def submit(self, rid, prompt, max_tokens=8, n=1, **kw):
        """n > 1: samples rid, rid/1, ..., each seed + j (as the scheduler's server does)."""
        def sample(j):
            sid = rid if j == 0 else f"{rid}/{j}"
            self.outputs[sid] = []
            seed = {"seed": kw["seed"] + j} if "seed" in kw else {}
            return Request(sid, list(prompt), SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, **{"logprobs": -1, **kw, **seed}),
                eos_token_ids=[])
        samples = [sample(j) for j in range(n)]
        self.sched.add_request(samples[0], samples[1:])

    def step(self):
        """One step on every worker that has work, as server.py drives them: a regular plan
        when the worker is idle, the next decode step planned ahead while one runs; returns
        whether any ran."""
        ran = False
        for wid, worker in list(self.workers.items()):
            sent = self.sent.setdefault(wid, collections.deque())
            if not sent and self.sched.has_work(wid):
                plan = self.sched.schedule(wid)
                if plan is not None:
                    sent.append(plan)
            if not sent:
                continue
            ahead = self.sched.schedule_ahead(wid)
            if ahead is not None:
                sent.append(ahead)
                self.ahead_plans += 1
            plan = sent.popleft()
            ran = True
            sub_step, more = 0, True
            while more:  # a plan of several decode steps answers after each
                result = worker.execute(plan, sub_step)
                for out in self.sched.update(wid, result):
                    self.outputs[out.request_id].append(out)
                sub_step, more = sub_step + 1, result.more
            # the worker holds no request state the scheduler does not know of (or drops next)
            if wid in self.sched.workers:
                w = self.sched.workers[wid]
                assert set(worker.requests) <= w.known | set(w.to_drop), wid
            if plan.sends and self.hold_sends:
                self.held.append((wid, plan.sends))
            elif plan.sends:
                self.sched.transfers_done(wid, worker.send_kv(plan.sends))
        return ran

    def run(self, max_steps=500):
        for _ in range(max_steps):
            if not self.step():
                return
        raise AssertionError("did not settle")

    def tokens(self, rid):
        return [t for o in self.outputs[rid] for t in o.token_ids]

    def finish_reason(self, rid):
        return self.outputs[rid][-1].finish_reason

    def assert_all_free(self):
        """Every block free, and no request state left on any worker."""
        for w in self.sched.workers.values():
            assert w.kv.num_free_blocks == w.kv.num_blocks, w.worker_id
            assert not w.kv.request_ids()
        for wid, worker in self.workers.items():
            assert worker.requests == {}, wid
            assert not worker.receiver._expected, wid


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def _prompt(n, seed):
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture
def cluster(tiny_llama, request):
    made = []

    def make(roles_blocks, **kw):
        c = Cluster(tiny_llama, roles_blocks, **kw)
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()


def test_disaggregated_requests_match_hf_and_free_every_block(cluster, hf):
    c = cluster([("prefill", 64), ("decode", 64)], max_num_batched_tokens=24)
    prompts = {f"r{n}": _prompt(n, n) for n in (1, 3, 4, 5, 30)}
    for rid, p in prompts.items():
        c.submit(rid, p)
    c.run()
    for rid, p in prompts.items():
        assert c.tokens(rid) == _greedy(hf, p, 8), rid
        assert c.finish_reason(rid) == "length"
    c.assert_all_free()
    p, d = (w.counters for w in c.sched.workers.values())
    assert p.prompt_tokens_computed == sum(map(len, prompts.values()))
    assert p.kv_blocks_sent == d.kv_blocks_received == sum(-(-len(x) // 4) for x in prompts.values())
    assert d.prompt_tokens_computed == 0


def test_colocated_without_prefill_workers(cluster, hf):
    c = cluster([("decode", 64)])
    c.submit("a", _prompt(13, 1), max_tokens=6)
    c.run()
    assert c.tokens("a") == _greedy(hf, _prompt(13, 1), 6)
    c.assert_all_free()


def test_abort_midway_frees_blocks(cluster):
    c = cluster([("prefill", 64), ("decode", 64)])
    c.submit("a", _prompt(10, 2), max_tokens=50)
    c.submit("b", _prompt(10, 3), max_tokens=5)
    for _ in range(4):
        c.step()
    out = c.sched.abort("a")
    assert out.finish_reason == "abort"
    c.run()
    assert c.finish_reason("b") == "length"
    assert len(c.tokens("a")) < 50
    c.assert_all_free()


def test_preemption_by_recompute_keeps_greedy_tokens(cluster, hf):
    # 8 decode blocks of 4 tokens: three 6-token prompts growing to 18 tokens cannot all fit
    c = cluster([("prefill", 64), ("decode", 8)])
    prompts = {f"p{i}": _prompt(6, 10 + i) for i in range(3)}
    for rid, p in prompts.items():
        c.submit(rid, p, max_tokens=12)
    c.run()
    assert c.sched.num_preemptions > 0
    for rid, p in prompts.items():
        assert c.tokens(rid) == _greedy(hf, p, 12), rid
    c.assert_all_free()


def test_lost_decode_worker_requests_resume_elsewhere(cluster, hf):
    c = cluster([("prefill", 64), ("decode", 64), ("decode", 64)])
    prompts = {f"q{i}": _prompt(9, 20 + i) for i in range(4)}
    for rid, p in prompts.items():
        c.submit(rid, p, max_tokens=10)
    for _ in range(5):
        c.step()
    lost = next(w for w in c.sched.workers.values()
                if w.role == "decode" and w.decoding)
    c.sched.remove_worker(lost.worker_id)
    c.lose(lost.worker_id)
    c.run()
    for rid, p in prompts.items():
        assert c.tokens(rid) == _greedy(hf, p, 10), rid
    c.assert_all_free()


def test_seeded_sampling_survives_preemption(cluster):
    kw = dict(temperature=1.0, seed=7)
    roomy = cluster([("prefill", 64), ("decode", 64)])
    roomy.submit("s", _prompt(6, 5), max_tokens=12, **kw)
    roomy.run()
    tight = cluster([("prefill", 64), ("decode", 5)])
    tight.submit("s", _prompt(6, 5), max_tokens=12, **kw)
    tight.submit("t", _prompt(6, 6), max_tokens=12, **kw)
    tight.run()
    assert tight.sched.num_preemptions > 0
    assert tight.tokens("s") == roomy.tokens("s")
    tight.assert_all_free()


def test_incompatible_worker_is_refused(cluster, tiny_models):
    c = cluster([("decode", 16)])
    _, reg = c.extra_worker(role="prefill", model=str(tiny_models["qwen3"]))
    with pytest.raises(RegistrationError, match="fingerprint"):
        c.sched.add_worker(reg)
    reg = replace(reg, model_fingerprint=c.sched.workers[next(iter(c.sched.workers))].fingerprint,
                  layout=replace(reg.layout, block_size=8))
    with pytest.raises(RegistrationError, match="KV layout"):
        c.sched.add_worker(reg)


def test_worker_without_a_transport_to_its_peers_is_refused(cluster):
    """A prefill worker offering only shm on another host could never send KV to the decode
    worker: refused at registration, not hung at the first request."""
    c = cluster([("decode", 16)])
    decode = next(iter(c.sched.workers.values()))
    reg = replace(c.registrations[0], worker_id="elsewhere", role="prefill",
                  host_id="another-host", transports=("shm",))
    with pytest.raises(RegistrationError, match="no KV transport .* shm works only within"):
        c.sched.add_worker(reg)
    assert "elsewhere" not in c.sched.workers
    reg = replace(reg, host_id=decode.host_id)  # the same host: shm works
    c.sched.add_worker(reg)


def test_requests_that_never_fit_are_refused(cluster):
    c = cluster([("decode", 4)])
    with pytest.raises(ValueError, match="never fit"):
        c.submit("big", _prompt(10, 1), max_tokens=10)
    with pytest.raises(ValueError, match="maximum model length"):
        c.submit("long", _prompt(10, 1), max_tokens=5000)


def _free(c, role):
    w = next(w for w in c.sched.workers.values() if w.role == role)
    return w.kv.num_free_blocks


def test_abort_while_kv_is_in_flight_frees_only_after_the_send(cluster):
    c = cluster([("prefill", 16), ("decode", 16)])
    c.hold_sends = True
    c.submit("a", _prompt(9, 4), max_tokens=20)
    while not c.held:
        c.step()
    assert c.tokens("a")  # the first token went out before the KV send finished
    c.sched.abort("a")
    # both sides' blocks are still being read and written by the send
    assert _free(c, "prefill") == 16 - 3 and _free(c, "decode") == 16 - 3
    c.deliver()
    c.run()
    c.assert_all_free()


def test_prefill_worker_lost_mid_transfer_recomputes_on_the_decode_worker(cluster, hf):
    c = cluster([("prefill", 16), ("decode", 16)])
    c.hold_sends = True
    prompt = _prompt(9, 8)
    c.submit("a", prompt, max_tokens=10)
    while not c.held:
        c.step()
    pid = next(w for w in c.sched.workers.values() if w.role == "prefill").worker_id
    c.sched.remove_worker(pid)
    c.lose(pid)
    c.held.clear()
    c.run()  # no prefill worker left: the decode worker prefills prompt + first token itself
    assert c.tokens("a") == _greedy(hf, prompt, 10)
    c.assert_all_free()


def test_decode_worker_lost_mid_transfer_frees_the_senders_blocks_when_done(cluster, hf):
    c = cluster([("prefill", 16), ("decode", 16), ("decode", 16)])
    c.hold_sends = True
    prompt = _prompt(9, 12)
    c.submit("a", prompt, max_tokens=10)
    while not c.held:
        c.step()
    did = next(iter(c.sched.transfers.by_id.values())).dst.worker_id
    c.sched.remove_worker(did)
    c.lose(did)
    assert _free(c, "prefill") == 16 - 3  # the send still reads them
    c.deliver()  # the send fails or lands in a dead cache; either way the blocks come back
    c.hold_sends = False
    c.run()
    assert c.tokens("a") == _greedy(hf, prompt, 10)
    c.assert_all_free()


def _by_role(c, role):
    return next(w for w in c.sched.workers.values() if w.role == role)


def test_repeated_prompt_prefills_only_its_tail_and_sends_only_missing_blocks(cluster, hf):
    c = cluster([("prefill", 64), ("decode", 64)])
    prompt = _prompt(23, 30)  # blocks of 4: 5 full + 3 tokens
    c.submit("first", prompt, max_tokens=6)
    c.run()
    p, d = _by_role(c, "prefill"), _by_role(c, "decode")
    computed, sent = p.counters.prompt_tokens_computed, p.counters.kv_blocks_sent
    assert (computed, sent) == (23, 6)
    c.submit("again", prompt, max_tokens=6)
    c.run()
    assert c.tokens("again") == c.tokens("first") == _greedy(hf, prompt, 6)
    assert c.outputs["again"][-1].num_cached_tokens == 20
    assert p.counters.prompt_tokens_computed - computed == 3
    # the decode worker held all 5 full prompt blocks: only the last, partial one travels
    assert p.counters.kv_blocks_sent - sent == 1
    assert d.counters.kv_blocks_received == p.counters.kv_blocks_sent
    c.assert_all_free()


def test_short_prompt_finishes_prefill_while_a_long_one_is_chunking(cluster, hf):
    c = cluster([("prefill", 64), ("decode", 64)], max_num_batched_tokens=8,
                max_num_partial_prefills=2, max_long_partial_prefills=1,
                long_prefill_token_threshold=6)
    long, short = _prompt(60, 40), _prompt(5, 41)
    c.submit("long", long, max_tokens=4)
    c.step()
    c.submit("short", short, max_tokens=4)
    while not c.tokens("short"):
        c.step()
    assert c.tokens("long") == []  # still chunking: 60 tokens at most 6 per step
    c.run()
    assert c.tokens("long") == _greedy(hf, long, 4)
    assert c.tokens("short") == _greedy(hf, short, 4)
    c.assert_all_free()


def test_one_partial_prefill_at_a_time_when_asked(cluster):
    c = cluster([("prefill", 64), ("decode", 64)], max_num_batched_tokens=8,
                max_num_partial_prefills=1)
    c.submit("a", _prompt(20, 1), max_tokens=2)
    c.submit("b", _prompt(20, 2), max_tokens=2)
    c.step()
    p = _by_role(c, "prefill")
    assert [r.request_id for r in p.prefilling] == ["a"]  # b waits: a is partial already
    c.run()
    c.assert_all_free()


def test_short_prompts_bypass_a_busy_prefill_pool(cluster, hf):
    c = cluster([("prefill", 64), ("decode", 64)], prefill_bypass_threshold=8)
    short, long = _prompt(6, 50), _prompt(30, 51)
    c.submit("long", long, max_tokens=5)
    p, d = _by_role(c, "prefill"), _by_role(c, "decode")
    c.sent[p.worker_id] = collections.deque([c.sched.schedule(p.worker_id)])
    c.submit("short", short, max_tokens=5)  # p runs a step: busy
    c.sent[d.worker_id] = collections.deque([c.sched.schedule(d.worker_id)])
    c.run()
    assert d.counters.prompt_tokens_computed == 6
    assert p.counters.prompt_tokens_computed == 30
    assert c.tokens("short") == _greedy(hf, short, 5)
    assert c.tokens("long") == _greedy(hf, long, 5)
    c.assert_all_free()


def test_colocated_mode_refuses_prefill_workers(cluster, tiny_llama):
    c = cluster([("decode", 16)], mode="colocated")
    _, reg = c.extra_worker(role="prefill", model=str(tiny_llama), dtype="float32")
    with pytest.raises(RegistrationError, match="colocated"):
        c.sched.add_worker(reg)


def test_waiting_queue_is_bounded(cluster):
    from services.scheduler.scheduler import QueueFull
    c = cluster([("decode", 16)], max_waiting_requests=2)
    c.submit("a", _prompt(4, 1))
    c.submit("b", _prompt(4, 2))
    with pytest.raises(QueueFull):
        c.submit("c", _prompt(4, 3))
    c.run()
    c.submit("c", _prompt(4, 3))  # room again once the queue drained
    c.run()
    c.assert_all_free()


def test_preemption_takes_the_least_important_request(cluster):
    c = cluster([("prefill", 64), ("decode", 6)], scheduling_policy="priority")
    c.submit("urgent", _prompt(6, 60), max_tokens=12, )
    c.sched.requests["urgent"].priority = -1
    c.submit("relaxed", _prompt(6, 61), max_tokens=12)
    c.run()
    assert c.sched.num_preemptions > 0
    # the urgent one was never the victim: its tokens never had to be recomputed
    assert len(c.tokens("urgent")) == 12 == len(c.tokens("relaxed"))
    c.assert_all_free()


@pytest.mark.parametrize("transport", ["tcp", "nccl"])
def test_kv_over_the_network_transports_matches_hf(cluster, hf, transport):
    c = cluster([("prefill", 64), ("decode", 64)], worker_kw={"kv_transports": (transport,)})
    prompts = {f"t{n}": _prompt(n, 300 + n) for n in (3, 17, 40)}
    for rid, p in prompts.items():
        c.submit(rid, p, max_tokens=6)
    c.run()
    for rid, p in prompts.items():
        assert c.tokens(rid) == _greedy(hf, p, 6), rid
    p, d = _by_role(c, "prefill"), _by_role(c, "decode")
    assert p.counters.kv_blocks_sent == d.counters.kv_blocks_received > 0
    c.assert_all_free()


def test_broken_tcp_transfer_is_recomputed_on_the_decode_worker(cluster, hf):
    c = cluster([("prefill", 64), ("decode", 64)],
                worker_kw={"kv_transports": ("tcp",), "kv_transfer_timeout_s": 2.0})
    d = _by_role(c, "decode")
    c._await(c.workers[d.worker_id].listeners["tcp"].close())  # nothing listens any more
    prompt = _prompt(21, 400)
    c.submit("a", prompt, max_tokens=6)
    c.run()
    assert c.tokens("a") == _greedy(hf, prompt, 6)
    assert d.counters.prompt_tokens_computed == 21  # the whole prompt, recomputed there
    c.assert_all_free()


def test_the_prefill_worker_holding_the_prefix_takes_the_request(cluster, hf):
    c = cluster([("prefill", 64), ("prefill", 64), ("decode", 64)])
    p1, p2 = [w for w in c.sched.workers.values() if w.role == "prefill"]
    prompt = _prompt(30, 600)
    c.submit("first", prompt, max_tokens=4)
    plan = c.sched.schedule(p2.worker_id)  # p2 happens to take the first one
    c.sched.update(p2.worker_id, c.workers[p2.worker_id].execute(plan))
    c.run()
    c.submit("again", prompt[:28] + [7, 7], max_tokens=4)
    c.run()  # p1 plans first each round, yet leaves it to p2, which caches 7 of its blocks
    assert p1.counters.prompt_tokens_computed == 0
    assert p2.counters.prompt_tokens_computed == 30 + 30 - 28
    assert c.tokens("again") == _greedy(hf, prompt[:28] + [7, 7], 4)
    c.assert_all_free()


@pytest.mark.parametrize("bypass", [False, True])
def test_saturated_prefill_pool_sends_prompts_to_a_decode_worker_with_room(cluster, hf, bypass):
    # P, free once it has finished the long prompt, would lend D its cores for `other`
    c = cluster([("prefill", 64), ("decode", 64)], max_num_batched_tokens=8,
                prefill_bypass_threshold=8, saturated_prefill_bypass=bypass,
                shared_cores_prefill_bypass=False)
    long, other = _prompt(40, 700), _prompt(20, 701)
    c.submit("long", long, max_tokens=3)
    p = _by_role(c, "prefill")
    plan = c.sched.schedule(p.worker_id)  # p starts chunking the long prompt: p is saturated
    c.sched.update(p.worker_id, c.workers[p.worker_id].execute(plan))
    c.submit("other", other, max_tokens=3)
    c.run()
    d = _by_role(c, "decode")
    assert d.counters.prompt_tokens_computed == (20 if bypass else 0)
    assert c.tokens("other") == _greedy(hf, other, 3)
    assert c.tokens("long") == _greedy(hf, long, 3)
    c.assert_all_free()


@pytest.mark.parametrize("transport", ["shm", "tcp", "nccl"])
def test_last_chunk_streams_its_kv_layer_by_layer(cluster, hf, transport):
    c = cluster([("prefill", 64), ("decode", 64)], max_num_batched_tokens=8,
                worker_kw={"kv_transports": (transport,)})
    p = _by_role(c, "prefill")
    sender = c.workers[p.worker_id].senders[transport]
    calls = []
    real = sender.send_layers

    def recording(*args, **kw):
        calls.append(args[5:7] + (kw["last"],))
        return real(*args, **kw)
    sender.send_layers = recording
    prompt = _prompt(30, 900)  # 4 steps of 8 tokens: the decode worker expects it by the last
    c.submit("a", prompt, max_tokens=5)
    c.run()
    assert c.tokens("a") == _greedy(hf, prompt, 5)
    layers = c.workers[p.worker_id].cache.layout.num_layers
    assert calls == [(i, i + 1, i == layers - 1) for i in range(layers)]  # layer by layer
    c.assert_all_free()


# ---- parallel sampling (n > 1) ------------------------------------------------------------------

def _independent(cluster, prompt, n, **kw):
    """Each sample run on its own (n = 1, seed + j): what the samples of one request must give."""
    c = cluster([("prefill", 64), ("decode", 64)], max_num_batched_tokens=64)
    for j in range(n):
        c.submit(f"i{j}", prompt, **{**kw, "seed": kw["seed"] + j})
    c.run()
    return [c.tokens(f"i{j}") for j in range(n)]


@pytest.mark.parametrize("prompt_len", [10, 12])  # a partial last block (copied), none
@pytest.mark.parametrize("roles", [("prefill", "decode"), ("decode",)])
def test_samples_share_the_prompt_and_equal_independent_requests(cluster, prompt_len, roles):
    kw = dict(max_tokens=10, temperature=1.5, seed=30)
    prompt = _prompt(prompt_len, 4)
    expected = _independent(cluster, prompt, 3, **kw)
    # distinct first tokens: a partial block shared instead of copied would change what follows
    assert len({t[0] for t in expected}) == 3
    c = cluster([(r, 64) for r in roles], max_num_batched_tokens=64)
    c.submit("g", prompt, n=3, **kw)
    for _ in range(50):
        c.step()
        d = next(w for w in c.sched.workers.values() if w.role == "decode")
        if len(d.kv.request_ids()) == 3:
            break
    held = [d.kv.get_block_ids(r) for r in ("g", "g/1", "g/2")]
    full = prompt_len // 4
    assert held[0][:full] == held[1][:full] == held[2][:full]  # shared, ref counted
    assert all(d.kv.pool.ref_cnt[b] == 3 for b in held[0][:full])
    if prompt_len % 4:  # each sample has its own copy of the partial block
        assert len({h[full] for h in held}) == 3
    c.run()
    assert [c.tokens(r) for r in ("g", "g/1", "g/2")] == expected
    counters = {w.role: w.counters for w in c.sched.workers.values()}
    first = counters["prefill" if "prefill" in counters else "decode"]
    assert first.prompt_tokens_computed == prompt_len  # prefilled once
    if "prefill" in counters:
        assert counters["decode"].kv_blocks_received == -(-prompt_len // 4)  # sent once
    c.assert_all_free()


def test_greedy_samples_all_match_hf(cluster, hf):
    prompt = _prompt(9, 3)
    c = cluster([("prefill", 64), ("decode", 64)])
    c.submit("g", prompt, n=3, max_tokens=6)
    c.run()
    assert c.tokens("g") == c.tokens("g/1") == c.tokens("g/2") == _greedy(hf, prompt, 6)
    c.assert_all_free()


def test_a_sample_aborted_before_its_first_token_leaves_the_others_alone(cluster):
    kw = dict(max_tokens=6, temperature=1.5, seed=30)
    prompt = _prompt(10, 4)
    expected = _independent(cluster, prompt, 3, **kw)
    c = cluster([("prefill", 64), ("decode", 64)])
    c.submit("g", prompt, n=3, **kw)
    assert c.sched.abort("g/1").finish_reason == "abort"
    c.run()
    assert [c.tokens("g"), c.tokens("g/2")] == [expected[0], expected[2]]
    assert c.tokens("g/1") == []
    c.assert_all_free()


def test_samples_go_their_own_way_when_the_leader_ends_before_its_kv_lands(cluster):
    """The leader is aborted while its KV is in flight: its samples, which have their first
    token, are recomputed from prompt + that token and still give the same tokens."""
    kw = dict(max_tokens=6, temperature=1.5, seed=50)
    prompt = _prompt(10, 4)
    expected = _independent(cluster, prompt, 3, **kw)
    c = cluster([("prefill", 64), ("decode", 64)])
    c.hold_sends = True
    c.submit("g", prompt, n=3, **kw)
    for _ in range(10):
        c.step()
        if c.held:
            break
    assert [len(c.tokens(r)) for r in ("g", "g/1", "g/2")] == [1, 1, 1]
    c.sched.abort("g")
    c.hold_sends = False
    c.deliver()
    c.run()
    assert [c.tokens("g/1"), c.tokens("g/2")] == expected[1:]
    c.assert_all_free()


def test_preempted_samples_keep_their_tokens(cluster):
    kw = dict(max_tokens=12, temperature=1.5, seed=30)
    prompt = _prompt(6, 4)
    expected = _independent(cluster, prompt, 3, **kw)
    c = cluster([("prefill", 64), ("decode", 8)])  # 3 samples of 18 tokens need 12+ blocks
    c.submit("g", prompt, n=3, **kw)
    c.run()
    assert c.sched.num_preemptions > 0
    assert [c.tokens(r) for r in ("g", "g/1", "g/2")] == expected
    c.assert_all_free()


@pytest.mark.parametrize("lost", ["prefill", "decode"])
def test_samples_survive_a_lost_worker(cluster, lost):
    """The prefill worker dies with the KV in flight, or a decode worker dies while the samples
    decode there: every sample still gives its tokens, and every block comes back."""
    kw = dict(max_tokens=8, temperature=1.5, seed=30)
    prompt = _prompt(10, 4)
    expected = _independent(cluster, prompt, 3, **kw)
    c = cluster([("prefill", 64), ("prefill", 64), ("decode", 64), ("decode", 64)])
    c.hold_sends = lost == "prefill"
    c.submit("g", prompt, n=3, **kw)
    if lost == "prefill":
        while not c.held:
            c.step()
        victim = next(w for w in c.sched.workers.values() if w.role == "prefill" and w.prefilling)
        c.held.clear()
        c.hold_sends = False
    else:
        while not any(len(w.kv.request_ids()) == 3 for w in c.sched.workers.values()
                      if w.role == "decode"):
            c.step()
        c.step()
        victim = next(w for w in c.sched.workers.values() if w.role == "decode" and w.decoding)
    c.sched.remove_worker(victim.worker_id)
    c.lose(victim.worker_id)
    c.run()
    assert [c.tokens(r) for r in ("g", "g/1", "g/2")] == expected
    c.assert_all_free()


# ---- async scheduling ---------------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", [True, False])
def test_decode_steps_planned_ahead_keep_outputs_and_a_stop_discards_the_extra_token(
        cluster, hf, async_scheduling):
    """While a decode step runs its successor is planned already; a request that stops in the
    running step (a stop token: unforeseeable) had one more token computed, which nobody sees."""
    prompt = _prompt(11, 21)
    greedy = _greedy(hf, prompt, 12)
    c = cluster([("prefill", 64), ("decode", 64)], async_scheduling=async_scheduling)
    c.submit("long", prompt, max_tokens=12)
    c.submit("stops", prompt, max_tokens=12, stop_token_ids=[greedy[5]])
    c.run()
    assert c.tokens("long") == greedy
    assert c.tokens("stops") == greedy[:greedy.index(greedy[5]) + 1]
    assert c.finish_reason("stops") == "stop"
    assert (c.ahead_plans > 0) == async_scheduling
    c.assert_all_free()
    assert all(w.requests == {} for w in c.workers.values())  # the workers dropped both


def test_a_sample_preempted_in_the_plan_that_brings_it_leaves_nothing_behind(cluster):
    """Three samples of a 12-token prompt (three full blocks, shared) land on a decode worker
    with two free blocks: the plan that brings them in must preempt the last one. It never
    reaches the worker, resumes later, and still gives its tokens."""
    kw = dict(max_tokens=6, temperature=1.5, seed=30)
    prompt = _prompt(12, 4)
    expected = _independent(cluster, prompt, 3, **kw)
    c = cluster([("prefill", 64), ("decode", 5)])
    c.submit("g", prompt, n=3, **kw)
    c.run()
    assert c.sched.num_preemptions > 0
    assert [c.tokens(r) for r in ("g", "g/1", "g/2")] == expected
    c.assert_all_free()


def test_a_prompt_the_prefill_pool_has_cached_is_still_bypassed_or_prefilled(cluster, hf):
    """The prefill worker still caches most of a prompt the decode worker evicted: by its own
    cache the prompt is short, by the decode worker's it is not. Shortness is the decode
    workers' view, so one of the two takes it (it used to wait forever)."""
    c = cluster([("prefill", 32), ("decode", 8)], prefill_bypass_threshold=3)
    prompt = _prompt(9, 60)
    c.submit("first", prompt, max_tokens=4)
    c.run()
    c.submit("evict", _prompt(12, 61), max_tokens=20)  # 32 tokens: every decode block
    c.run()
    hashes = []
    extend_block_hashes(hashes, prompt, 4, "")
    p, d = _by_role(c, "prefill"), _by_role(c, "decode")
    assert len(p.kv.find_prefix(hashes, 9)) == 2 and d.kv.find_prefix(hashes, 9) == []
    c.submit("again", prompt, max_tokens=4)
    c.run()
    assert c.tokens("again") == _greedy(hf, prompt, 4)
    c.assert_all_free()


def test_blocks_decoded_by_steps_planned_ahead_are_prefix_cache_hits(cluster):
    """A second turn (prompt + answer + more) finds the answer's blocks cached, with async
    scheduling as without."""
    for async_scheduling in (True, False):
        c = cluster([("decode", 64)], async_scheduling=async_scheduling)
        prompt = _prompt(6, 62)
        c.submit("turn1", prompt, max_tokens=20)
        c.run()
        assert c.ahead_plans > 0 or not async_scheduling
        c.submit("turn2", prompt + c.tokens("turn1") + [5, 6, 7], max_tokens=2)
        c.run()
        assert c.outputs["turn2"][-1].num_cached_tokens == 24  # 6 + 20 tokens: 6 full blocks
        c.assert_all_free()


def test_receivers_forget_transfers_whose_request_went_away(cluster):
    """A request aborted after its KV landed but before it joined the decode batch, and one
    whose transfer failed: the decode worker stops expecting either transfer."""
    c = cluster([("prefill", 64), ("decode", 64)], worker_kw={"kv_transports": ("tcp",)})
    c.hold_sends = True
    c.submit("a", _prompt(9, 63), max_tokens=4)
    while not c.held:
        c.step()
    c.hold_sends = False
    c.deliver()  # landed: "a" waits among the decode worker's arrivals
    d = _by_role(c, "decode")
    assert d.arrivals
    c.sched.abort("a")
    c.run()
    c.assert_all_free()  # includes: no receiver expects a transfer any more


def test_workers_sharing_cores_run_each_step_with_the_threads_its_plan_gives(cluster, hf):
    """Both workers register this process's cores: the scheduler splits them while both
    compute and lends them all to the one that does; each step runs with its plan's count."""
    c = cluster([("prefill", 64), ("decode", 64)])
    assert all(r.cpu_cores == tuple(sorted(os.sched_getaffinity(0))) for r in c.registrations)
    seen = []
    for wid, worker in c.workers.items():
        def execute(plan, sub_step=0, run=worker.execute, wid=wid, threads=worker.threads):
            result = run(plan, sub_step)
            seen.append((wid.split("-")[1], plan.num_threads, threads.get()))
            return result
        worker.execute = execute
    prompt = _prompt(12, 800)
    c.submit("a", prompt, max_tokens=4)
    c.run()
    assert c.tokens("a") == _greedy(hf, prompt, 4)
    assert all(asked == ran for _, asked, ran in seen if asked)
    cores = len(os.sched_getaffinity(0))
    if cores > 1:
        assert ("prefill", cores, cores) in seen  # the prompt alone: every core
        assert {n for role, n, _ in seen if role == "decode"} >= {cores}
    c.assert_all_free()


def test_malformed_results_are_refused_whole_and_only_their_worker_goes(cluster, hf):
    """Answers a decode worker cannot have given to its running step (token ids that are not
    ids, more tokens than the step could add, prompt logprobs from position 0 or before, each
    amid plausible noise): update refuses each whole (ProtocolError) with nothing changed; the
    server then drops the worker and its requests finish elsewhere with HuggingFace's tokens."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from common.plans import PromptLogprobs, SampledToken, StepResult
    from services.scheduler.scheduler import ProtocolError

    c = cluster([("prefill", 64), ("decode", 64), ("decode", 64)])
    prompts = {f"m{i}": _prompt(7, 40 + i) for i in range(4)}
    for rid, p in prompts.items():
        c.submit(rid, p, max_tokens=10)
    for _ in range(6):
        c.step()
    victim = next(w for w in c.sched.workers.values() if w.role == "decode" and w.decoding)
    wid = victim.worker_id
    sent = c.sent.get(wid)  # its step planned ahead, if there is one; else a fresh plan
    plan = sent.popleft() if sent else c.sched.schedule(wid)
    assert plan is not None and plan.scheduled
    honest = c.workers[wid].execute(plan)
    ran = [s.request_id for s in plan.scheduled]

    def snapshot():
        reqs = {r.request_id: (r.status, tuple(r.output_token_ids), r.num_computed_tokens,
                               r.prefill_worker, r.decode_worker)
                for r in c.sched.requests.values()}
        workers = {w.worker_id: (w.kv.num_free_blocks, [s.step_id for s in w.steps],
                                 [r.request_id for r in w.decoding], len(w.prefilling))
                   for w in c.sched.workers.values()}
        return reqs, workers, c.sched.num_finished

    noise = st.lists(st.builds(SampledToken, request_id=st.sampled_from(["ghost", *ran]),
                               token_id=st.integers(0, 2000)), max_size=3)
    bad_token = st.builds(SampledToken, request_id=st.sampled_from(ran),
                          token_id=st.integers(max_value=-1) | st.integers(min_value=2 ** 31))
    too_many = st.sampled_from(ran).map(lambda rid: (SampledToken(rid, 5), SampledToken(rid, 6)))
    bad_logprobs = st.builds(PromptLogprobs, request_id=st.sampled_from(ran),
                             start=st.integers(max_value=0), logprobs=st.just(()))

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
    @given(kind=st.sampled_from(["token", "count", "logprobs"]), noise=noise,
           token=bad_token, pair=too_many, logprobs=bad_logprobs)
    def refused_whole(kind, noise, token, pair, logprobs):
        sampled = tuple(noise) + ((token,) if kind == "token" else ()) + \
            (pair if kind == "count" else ())
        result = StepResult(plan.step_id, sampled, counters=honest.counters,
                            prompt_logprobs=(logprobs,) if kind == "logprobs" else ())
        before = snapshot()
        with pytest.raises(ProtocolError):
            c.sched.update(wid, result)
        assert snapshot() == before

    refused_whole()
    c.sched.remove_worker(wid)  # what the server does on a ProtocolError
    c.lose(wid)
    c.run()
    for rid, p in prompts.items():
        assert c.tokens(rid) == _greedy(hf, p, 10), rid
    c.assert_all_free()


def test_malformed_registrations_are_refused_and_nothing_else_changes(cluster, hf):
    """Attach messages a wrong or hostile worker might send (Hypothesis): ids empty, repeated or
    unprintable, block counts from 0 to 2^31 (a free list that large would cost the scheduler
    gigabytes), impossible layouts, unknown transports, negative limits, cached blocks outside
    the cache: each is refused (RegistrationError) or, when valid, joins and leaves; the workers
    serving meanwhile never notice, and their requests finish with HuggingFace's tokens."""
    from dataclasses import replace

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from common.kv_layout import KVLayout

    c = cluster([("prefill", 64), ("decode", 64)])
    prompts = {f"a{i}": _prompt(9, 60 + i) for i in range(3)}
    for rid, p in prompts.items():
        c.submit(rid, p, max_tokens=10)
    for _ in range(4):
        c.step()
    honest = c.registrations[1]  # the decode worker's, as it sent it
    serving = {w: (s.kv.num_free_blocks, len(s.decoding), len(s.prefilling))
               for w, s in c.sched.workers.items()}
    sizes = st.integers(min_value=-2, max_value=2 ** 31 - 1)
    layouts = st.builds(KVLayout, num_layers=sizes, num_kv_heads=sizes, head_dim=sizes,
                        block_size=st.sampled_from([0, -4, 4, 1 << 17, 2 ** 31 - 1]),
                        dtype=st.sampled_from(["float32", "int8", "", "complex128"]))
    ids = st.sampled_from(["", "x" * 300, "bad\x00id", "ok-worker", *c.sched.workers])

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
    @given(worker_id=ids, num_blocks=sizes, layout=layouts | st.just(honest.layout),
           role=st.sampled_from(["decode", "prefill", "gateway", ""]),
           transports=st.lists(st.sampled_from(["shm", "tcp", "carrier-pigeon"]), max_size=3),
           max_model_len=st.integers(-5, 1 << 20),
           spec=st.integers(-3, 200), cores=st.lists(st.integers(-2, 8), max_size=3),
           cached=st.lists(st.tuples(st.integers(-5, 2 ** 31 - 1), st.binary(max_size=40)),
                           max_size=4))
    def refused_or_joined(worker_id, num_blocks, layout, role, transports, max_model_len, spec,
                          cores, cached):
        reg = replace(honest, worker_id=worker_id, num_blocks=num_blocks, layout=layout,
                      role=role, transports=tuple(transports), max_model_len=max_model_len,
                      num_speculative_tokens=spec, cpu_cores=tuple(cores),
                      cached_blocks=tuple(cached))
        before = set(c.sched.workers)
        try:
            joined = c.sched.add_worker(reg)
        except RegistrationError:
            assert set(c.sched.workers) == before
        else:  # valid after all: it served nothing, and leaves at once
            assert 1 <= joined.kv.num_blocks <= 1 << 22 and joined.worker_id not in before
            c.sched.remove_worker(joined.worker_id)
        assert {w: (s.kv.num_free_blocks, len(s.decoding), len(s.prefilling))
                for w, s in c.sched.workers.items()} == serving

    refused_or_joined()
    c.run()
    for rid, p in prompts.items():
        assert c.tokens(rid) == _greedy(hf, p, 10), rid
    c.assert_all_free()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_prefill_worker_takes_over_a_long_prompt_from_the_kv_the_decode_worker_sent(
        cluster, hf, transport):
    """The decode worker takes `long2` while the prefill worker chunks `long1`; at 10 ms a token
    there against 1 ms on the prefill worker, the prefill worker, once done with long1, gets
    the blocks of long2 the decode worker computed into its prefix cache (a prefix fill over
    the transport) and computes only the rest: the KV that moved is the real one, so the tokens
    are HuggingFace's."""
    c = cluster([("prefill", 64), ("decode", 64)], worker_kw={"kv_transports": (transport,)},
                max_num_batched_tokens=8, prefill_bypass_threshold=8, decode_prefill_tokens=8,
                max_num_partial_prefills=1, prefill_take_back=True)
    p, d = _by_role(c, "prefill"), _by_role(c, "decode")
    plans = collections.defaultdict(list)
    schedule = c.sched.schedule

    def recorded(wid):
        plan = schedule(wid)
        plans[wid].append(plan)
        return plan
    c.sched.schedule = recorded
    long1, long2 = _prompt(24, 900), _prompt(60, 901)
    c.submit("long1", long1, max_tokens=4)
    c.submit("long2", long2, max_tokens=4)
    for w in (p, d):  # p starts long1; d, its speed unmeasured, takes long2 beside it
        c.sched.update(w.worker_id, c.workers[w.worker_id].execute(c.sched.schedule(w.worker_id)))
    assert [r.request_id for r in d.prefilling] == ["long2"]
    p.prefill_speed.seconds_per_token, d.prefill_speed.seconds_per_token = 0.001, 0.01
    c.run()
    assert c.tokens("long1") == _greedy(hf, long1, 4)
    assert c.tokens("long2") == _greedy(hf, long2, 4)
    assert c.sched.num_long_prefills_taken_back == 1
    fills = [r for plan in plans[p.worker_id] if plan for r in plan.recvs]
    assert len(fills) == 1 and fills[0].transfer_id.startswith("long2/fill")
    filled = 4 * len(fills[0].block_ids)
    assert filled >= 8
    assert p.counters.prompt_tokens_computed == 24 + 60 - filled
    assert d.counters.kv_blocks_sent == len(fills[0].block_ids)
    c.assert_all_free()
