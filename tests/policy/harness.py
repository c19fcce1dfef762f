"""A scheduler with workers that keep a real worker's request bookkeeping but run no model:
each applies plans as common/worker/worker.py does (requests added, diffs, drops, expected
transfers, fork copies) and samples token `position % 1000` for a request whose last known
token a step computes, so every token is known in advance. Plans go in as the scheduler wrote
them, results come back as a worker would answer; KV sends are delivered when the harness says.
A worker that speculates (`speculate={worker id: (k, accepted)}`) has its drafts right `accepted`
times a step, within the lookahead slots its plan gives (and its request's max_tokens), and
answers those tokens and the one after them.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from common.kv_layout import KVLayout
from common.plans import (
    Registration,
    RequestError,
    SampledToken,
    StepPlan,
    StepResult,
    TransferDone,
    TransfersDone,
    WorkerCounters,
)
from common.sampling_params import SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Output, Request
from services.scheduler.scheduler import Scheduler

BLOCK = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BLOCK, dtype="float32")


def token_at(position: int) -> int:
    return position % 1000


def scheduled(plan: StepPlan) -> list[tuple[str, int]]:
    """A plan's scheduled tokens as (request id, tokens) pairs, in plan order."""
    return [(s.request_id, s.num_tokens) for s in plan.scheduled]


@dataclass
class _Held:
    tokens: list[int]
    num_prompt: int
    num_computed: int
    blocks: list[int]
    max_tokens: int
    forks: list[str] = field(default_factory=list)


class FakeWorker:
    def __init__(self, worker_id: str, accepted: int = 0):
        self.worker_id = worker_id
        self.accepted = accepted  # drafts right per step, where it speculates
        self.live: list[str] = []  # decoding again in the running plan's next step
        self.requests: dict[str, _Held] = {}
        self.expected: dict[str, tuple[str, int]] = {}  # transfer id -> request id, blocks
        self.landed: set[str] = set()        # transfer ids whose blocks arrived
        self.prompt_tokens = self.decoded = self.sent = self.received = self.steps = 0

    def counters(self) -> WorkerCounters:
        return WorkerCounters(self.prompt_tokens, self.decoded, self.sent, self.received,
                              self.steps)

    def execute(self, plan: StepPlan, sub_step: int = 0) -> StepResult:
        if sub_step:  # a plan of several decode steps: its live requests decode again
            return self._decode_again(plan, sub_step)
        errors = []
        for rid in plan.finished_request_ids:
            self.requests.pop(rid, None)
            self.expected = {t: e for t, e in self.expected.items() if e[0] != rid}
        for recv in plan.recvs:
            self.expected[recv.transfer_id] = (recv.request_id, len(recv.block_ids))
        failed = set()
        for new in plan.new_requests:
            if new.kv_transfer_id:
                if new.kv_transfer_id not in self.landed:
                    errors.append(RequestError(new.request_id, "its KV never landed"))
                    failed.add(new.request_id)
                    continue
                self.received += self.expected.pop(new.kv_transfer_id)[1]
            self.requests[new.request_id] = _Held(
                list(new.all_token_ids), new.num_prompt_tokens, new.num_computed_tokens,
                list(new.block_ids), new.sampling.max_tokens, [f.request_id for f in new.forks])
        for diff in plan.cached_requests:
            held = self.requests[diff.request_id]
            held.blocks.extend(diff.new_block_ids)
            held.tokens.extend(diff.new_token_ids)
        for c in plan.copies:
            if c.leader_id in failed:
                errors.append(RequestError(c.request_id, "its leader's KV never landed"))
        sampled = []
        for s in plan.scheduled:
            held = self.requests.get(s.request_id)
            if held is None:
                continue
            assert held.num_computed + s.num_tokens <= len(held.tokens), s
            assert -(-(held.num_computed + s.num_tokens) // BLOCK) <= len(held.blocks), s
            if s.num_lookahead:
                assert held.num_computed == len(held.tokens) - 1 > held.num_prompt - 1, s
                assert -(-(len(held.tokens) + s.num_lookahead) // BLOCK) <= len(held.blocks), s
                left = held.max_tokens - (len(held.tokens) - held.num_prompt) - 1
                drafts = min(self.accepted, s.num_lookahead, max(0, left))
                new = [token_at(len(held.tokens) + i) for i in range(drafts + 1)]
                sampled.extend(SampledToken(s.request_id, t) for t in new)
                held.tokens.extend(new)
                held.num_computed = len(held.tokens) - 1
                self.decoded += len(new)
                continue
            self.prompt_tokens += max(0, min(held.num_computed + s.num_tokens, held.num_prompt)
                                      - held.num_computed)
            self.decoded += held.num_computed >= held.num_prompt
            held.num_computed += s.num_tokens
            if held.num_computed == len(held.tokens):
                token = token_at(len(held.tokens))
                for rid in [s.request_id, *held.forks]:
                    sampled.append(SampledToken(rid, token))
                held.forks = []
                held.tokens.append(token)
        self.steps += 1
        return self._answer(plan, 0, sampled, errors)

    def _decode_again(self, plan: StepPlan, sub_step: int) -> StepResult:
        sampled = []
        for rid in self.live:
            held = self.requests[rid]
            token = token_at(len(held.tokens))
            held.tokens.append(token)
            held.num_computed += 1
            self.decoded += 1
            sampled.append(SampledToken(rid, token))
        self.steps += 1
        return self._answer(plan, sub_step, sampled, [])

    def _answer(self, plan: StepPlan, sub_step: int, sampled, errors) -> StepResult:
        """Decodes again, in the plan's next step, the requests that sampled a token with room
        for its KV and below their max_tokens (harness requests ignore eos)."""
        self.live = []
        if sub_step + 1 < plan.num_steps:
            for s in sampled:
                held = self.requests.get(s.request_id)
                if held is not None and len(held.tokens) - held.num_prompt < held.max_tokens \
                        and len(held.blocks) * BLOCK >= len(held.tokens) \
                        and held.num_computed == len(held.tokens) - 1:
                    self.live.append(s.request_id)
        return StepResult(plan.step_id, tuple(sampled), tuple(errors), self.counters(),
                          more=bool(self.live))

    def send(self, plan: StepPlan, peers: dict[str, FakeWorker],
             error: str = "") -> TransfersDone:
        done = []
        for send in plan.sends:
            dst = next((w for w in peers.values() if send.transfer_id in w.expected), None)
            if error or dst is None:
                done.append(TransferDone(send.transfer_id, error or "nobody expects it"))
                continue
            dst.landed.add(send.transfer_id)
            self.sent += len(send.src_block_ids)
            done.append(TransferDone(send.transfer_id))
        return TransfersDone(tuple(done), self.counters())


class Cluster:
    """roles: worker ids, each starting with its role's letter (p0, d1, ...), with their block
    counts. Steps every worker that has work, as server.py does, plans ahead included.
    cpu_cores: the cores every worker registers (all on one host), () for none."""

    def __init__(self, workers: dict[str, int], cpu_cores: tuple[int, ...] = (),
                 speculate: dict[str, tuple[int, int]] | None = None, **config):
        self.now = 0.0  # the scheduler's clock: steps take no time unless a test moves it
        self.sched = Scheduler(SchedulerConfig(**config), clock=lambda: self.now)
        self.workers: dict[str, FakeWorker] = {}
        for wid, blocks in workers.items():
            role = {"p": "prefill", "d": "decode"}[wid[0]]
            self.sched.add_worker(Registration(
                worker_id=wid, role=role, model_fingerprint="m", num_blocks=blocks,
                layout=LAYOUT, transports=("shm", "tcp"),
                kv_endpoints={"shm": f"shm://{wid}", "tcp": f"tcp://{wid}"}, host_id="h",
                cpu_cores=cpu_cores, num_speculative_tokens=(speculate or {}).get(wid, (0, 0))[0]))
            self.workers[wid] = FakeWorker(wid, (speculate or {}).get(wid, (0, 0))[1])
        self.outputs: dict[str, list[Output]] = collections.defaultdict(list)
        self.plans: dict[str, list[StepPlan]] = collections.defaultdict(list)  # as run
        self.sent: dict[str, collections.deque[StepPlan]] = collections.defaultdict(
            collections.deque)
        self.held_sends: list[tuple[str, StepPlan]] = []
        self.hold_sends = False

    def submit(self, rid: str, prompt: list[int], max_tokens: int = 4, n: int = 1,
               priority: int = 0, **sampling) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
        samples = [Request(rid if j == 0 else f"{rid}/{j}", list(prompt), params.for_sample(j),
                           eos_token_ids=[], priority=priority) for j in range(n)]
        self.sched.add_request(samples[0], samples[1:])

    def plan(self, wid: str) -> StepPlan | None:
        """The worker's next plan (a regular one when idle, else one planned ahead), queued to
        run; None when there is none."""
        sent = self.sent[wid]
        plan = None
        if not sent and self.sched.has_work(wid):
            plan = self.sched.schedule(wid)
        elif len(sent) == 1:
            plan = self.sched.schedule_ahead(wid)
        if plan is not None:
            sent.append(plan)
        return plan

    def run_step(self, wid: str, send_error: str = "") -> StepPlan:
        """Runs the oldest plan queued for wid; its sends are delivered (or held)."""
        plan = self.sent[wid].popleft()
        self.plans[wid].append(plan)
        sub_step, more = 0, True
        while more:  # a plan of several decode steps answers after each
            result = self.workers[wid].execute(plan, sub_step)
            for out in self.sched.update(wid, result):
                self.outputs[out.request_id].append(out)
            sub_step, more = sub_step + 1, result.more
        if plan.sends and self.hold_sends:
            self.held_sends.append((wid, plan))
        elif plan.sends:
            self.deliver(wid, plan, send_error)
        return plan

    def deliver(self, wid: str, plan: StepPlan, error: str = "") -> None:
        self.sched.transfers_done(wid, self.workers[wid].send(plan, self.workers, error))

    def step(self) -> bool:
        ran = False
        for wid in list(self.workers):
            if wid not in self.sched.workers:
                continue
            self.plan(wid)
            if self.sent[wid]:
                self.plan(wid)  # ahead, while the first runs
                self.run_step(wid)
                ran = True
        return ran

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.step():
                return
        raise AssertionError("did not settle")

    def lose(self, wid: str) -> None:
        self.sched.remove_worker(wid)
        del self.workers[wid]
        self.sent.pop(wid, None)

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.token_ids]

    def assert_all_free(self) -> None:
        for w in self.sched.workers.values():
            assert w.kv.num_free_blocks == w.kv.num_blocks, w.worker_id
            assert w.kv.pool.ref_cnt == [0] * w.kv.num_blocks, w.worker_id
            assert not w.kv.request_ids(), w.worker_id
        for wid, worker in self.workers.items():
            assert not worker.requests and not worker.expected, wid
