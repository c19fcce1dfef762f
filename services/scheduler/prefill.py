"""Prefill: which prompts a worker starts or continues in a step, in chunks under the step's
token budget, and, on a prefill worker, which decode worker their KV goes to.

A prompt is a *partial* prefill from the step that starts it until the step that finishes it.
At most max_num_partial_prefills are partial on a worker at once, at most
max_long_partial_prefills of them long; a prompt that fits whole in what is left of the budget
may always start, so short prompts pass long ones, and a long one does not start in the step
that ends another prompt's prefill (it would hold back that prompt's first token).

Who prefills a prompt:

    prefill workers exist?  no  -> its decode worker
                            yes -> a prefill worker, unless its decode worker takes it beside
                                   its batch (at most --decode-prefill-tokens a step):
                                   - its uncached tail there is at most
                                     --prefill-bypass-threshold tokens and no prefill worker is
                                     free to start it now, or that decode worker caches more of
                                     it than any prefill worker (no recompute, no KV hop), or
                                   - it is longer, a prefill worker sharing the decode
                                     worker's cores is free (--shared-cores-prefill-bypass),
                                     and the decode worker has a batch to step beside it, no
                                     long prompt of its own, a quarter of its blocks free
                                     and as much of the prompt cached as any prefill
                                     worker, or
                                   - it is longer, every prefill worker is busy
                                     (--saturated-prefill-bypass), the decode worker has no
                                     long prompt of its own and a quarter of its blocks free,
                                     and at the prefill speeds measured so far (its own at
                                     the pace the short prompts arriving leave it,
                                     `_held_seconds`) it finishes the prompt before a prefill
                                     worker would get through its backlog and the prompt (in
                                     1/--decode-hold-margin of that time), the oldest such one
                                     waiting; or, at a prefill load of 1 or more, finishing
                                     none sooner, the newest (`_newest_at_overload`), or
                                   - its KV transfer failed once (prefill_locally)
                                   and, among prefill workers, the one caching most of its
                                   prefix

                                   A long prompt is held beside the batch (either bypass) only
                                   when that pays (--price-holds, `_hold_pays`): the batch
                                   loses less than the prompt gains, the latter weighed up by
                                   the prefill workers' load, the former counting only what
                                   takes its requests past --tpot-slo-ms

With --prefill-take-back (off by default: docs/performance.md), a long prompt a decode worker
holds goes to a prefill worker that has none left to compute, when that one would finish it
sooner than the decode worker from where it is (in 1/--decode-hold-margin of that time): the
decode worker's pace beside its batch falls as the batch grows, and a prompt taken when it was
the sooner one would otherwise end the slowest while a prefill worker idles. The decode worker
first sends the blocks it has computed into the prefill worker's prefix cache (a prefix fill,
transfers.py; it goes on computing meanwhile), and the prompt goes back to the front of the
queue once they are there: the prefill worker goes on from them, recomputing only what the
decode worker computed during the fill. Where no fill can be made (no transport between the
two, prompt logprobs, a fill that failed) it starts from the beginning, and that counts once
more the time of the tokens the decode worker computed (work thrown away, which delays the
prompts it takes next). The decode worker's pace is the one it has had on that prompt since it
took it; its blocks stay in its prefix cache, so the KV sent back to it later skips them.

So a free prefill worker takes every prompt but a long one its decode worker can take beside
its batch on shared cores, and while prefill workers are busy short prompts do not queue behind
long ones. On shared cores (CPU workers of one host, cores lent, cores.py) a prefill worker
computes a long prompt on the one core a decode batch leaves it, while the decode worker,
stepping a few sequences, reads the weights for little; the decode worker computing the prompt
beside its batch gets every core while the prefill workers idle, its KV stays put, and the
prefill worker stays free for the next one. When long prompts arrive faster than the prefill
workers finish them, a decode worker takes its share beside its batch: a
step of a few sequences costs nearly what a step of none does (the weights are read either
way), so its core computes prompts instead of stepping nearly empty. While it holds a long
prompt its steps carry the prompt tokens that fit in --decode-step-target-ms (250) at the pace
of its last such step on as many threads (--decode-long-prefill-tokens, 32, before one is
timed): the TPOT its requests see meanwhile, whatever its batch, model, hardware or share of
the cores. That is the price of a hold: each request of the batch steps at the target until the
prompt is done or its own tokens are, where on its own it would step in a fraction of that.
What a request loses counts only past its TPOT budget (--tpot-slo-ms, 30, times its tokens
after the first, less what it has spent since its first): at a light load a long prompt
meeting a few streams well within theirs is held, and gets every core where on the prefill
worker it would get the one the batch leaves it, while a stream a hold would take past its
budget keeps its short steps and the prompt goes to the prefill worker; under a burst of long
prompts, each second the prefill workers lose delays the prompts behind, and the decode worker
takes its share.
"""
from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from common.plans import ScheduledTokens, StepPlan
from services.scheduler.config import SchedulerConfig
from services.scheduler.cores import shares_cores, threads_for
from services.scheduler.placement import Placement
from services.scheduler.request import Request, Status
from services.scheduler.request_queue import RequestQueue
from services.scheduler.transfers import Transfers
from services.scheduler.worker_state import MIN_TIMED_PREFILL, WorkerState, transport_between
from services.scheduler.workers import Workers

ADMISSION_LOOKAHEAD = 8  # waiting requests a worker looks past a head that cannot start now
LOAD_WINDOW_S = 20.0  # arrivals over this long measure the prefill workers' and batches' loads


class ShortLoad(NamedTuple):
    """The short prompts arriving at each decode worker (`Prefill.short_load`)."""
    rate: float = 0.0           # requests a second
    tokens_per_s: float = 0.0   # their prompt tokens a second
    mean_tokens: float = 0.0    # the tokens each generates at most, on average


def _past_beside(each: float, span: float, slow: float, slack: float) -> float:
    """Seconds past their TPOT budgets that requests arriving at one a second through `span`
    seconds spend inside it: one arriving at s stays min(each, span - s) seconds, losing `slow`
    of each, and `slack` of what it loses still keeps it within its budget."""
    if slow <= 0 or slack >= slow * min(each, span):
        return 0.0
    start, top = slack / slow, min(each, span)  # inside this long, it is at its budget
    past = slow / 2 * (top * top - start * start) - slack * (top - start)
    return past + max(0.0, span - each) * (slow * each - slack)


@dataclass(frozen=True)
class TakeBack:
    """A long prompt a prefill worker takes over from the decode worker `src` holding it:
    first `fill` blocks of it into its prefix cache after its cached `prefix` (a prefix fill),
    or, with none to fill, the prompt itself now."""
    request: Request
    src: WorkerState
    prefix: tuple[int, ...] = ()
    fill: int = 0


class Prefill:
    def __init__(self, config: SchedulerConfig, workers: Workers, waiting: RequestQueue,
                 transfers: Transfers, placement: Placement, next_id: Callable[[], int],
                 requeue: Callable[[Request], None], clock: Callable[[], float],
                 threads: Callable[[WorkerState], int]):
        self.config = config
        self.workers = workers
        self.waiting = waiting
        self.transfers = transfers
        self.placement = placement
        self._next_id = next_id
        self._requeue = requeue
        self._clock = clock  # a decode worker's pace on a long prompt it holds
        self._threads = threads  # the threads a worker's next step runs on (cores.py)
        self.num_long_on_decode = 0  # long prompts decode workers took beside their batch
        self.num_long_taken_back = 0  # ... that went back to a prefill worker (`to_take_back`)
        self.num_long_left = 0  # ... that one would have taken but for its batch (`_hold_pays`),
                                # counted when a prefill worker starts them
        self._long_arrivals: deque[tuple[float, int]] = deque()  # (clock, prompt tokens)
        # (clock, prompt tokens, tokens it generates at most)
        self._short_arrivals: deque[tuple[float, int, int]] = deque()

    def arrived(self, req: Request) -> None:
        """Counts a new prompt into a load: a long one into the prefill workers' (`long_load`),
        a short one into the decode workers' batches (`short_load`)."""
        if req.num_tokens > self.config.prefill_bypass_threshold:
            self._long_arrivals.append((self._clock(), req.num_tokens))
        else:
            self._short_arrivals.append((self._clock(), req.num_tokens, self._tokens_left(req)))
        self._forget_old_arrivals()

    def _forget_old_arrivals(self) -> None:
        """Drops the arrivals older than LOAD_WINDOW_S."""
        since = self._clock() - LOAD_WINDOW_S
        for arrivals in (self._long_arrivals, self._short_arrivals):
            while arrivals and arrivals[0][0] < since:
                arrivals.popleft()

    def admits(self, w: WorkerState) -> bool:
        """Whether w may take requests from the waiting queue at all."""
        if w.leaving:
            return False
        if w.role == "prefill":
            return bool(self.workers.of_role("decode"))
        return (not self.workers.has_prefill or self.config.prefill_bypass_threshold > 0
                or self.config.saturated_prefill_bypass
                or any(r.prefill_locally for r in itertools.islice(self.waiting, self.lookahead)))

    @property
    def lookahead(self) -> int:
        return self.config.max_num_partial_prefills + ADMISSION_LOOKAHEAD

    def schedule(self, w: WorkerState, plan: StepPlan, budget: int) -> bool:
        """Chunks of w's partial prefills, then new prompts, while the budget lasts. A decode
        worker holding a long prompt (saturated bypass) keeps its steps to `held_tokens`,
        short prompts first, the long prompt's chunk last; returns whether it holds one."""
        partials = self._partials(w)
        held = [r for r in partials if self._beside_batch(w, r)]
        if held:
            budget = min(budget, self.held_tokens(w))
        completes = False  # a prompt started before gets its first token from this step
        for req in partials:
            if budget <= 0:
                break
            if req not in held:
                budget -= self._schedule_chunk(w, plan, req, budget)
                completes |= req.num_computed_tokens == req.num_tokens
        if (back := self.to_take_back(w)) is not None:
            self._take_back(w, back)
        budget = self._admit(w, plan, budget, completes)
        for req in held:
            if budget > 0:
                budget -= self._schedule_chunk(w, plan, req, budget)
        return any(r.status is Status.PREFILLING and self._beside_batch(w, r)
                   for r in w.prefilling)  # held before, or taken in this step

    def held_tokens(self, w: WorkerState) -> int:
        """Prompt tokens of decode worker w's next step while it holds a long prompt: sized for
        the threads that step runs on."""
        return w.held_step_tokens.get(self._threads(w)) or self.config.decode_long_prefill_tokens

    def held_step_timed(self, w: WorkerState, threads: int, prompt_tokens: int,
                        seconds: float) -> None:
        """Sizes w's next steps beside its long prompt on `threads` threads from one such step
        on as many that computed prompt_tokens in `seconds` (plan out to result in): as many as
        fit in --decode-step-target-ms at that step's pace, between MIN_TIMED_PREFILL (however
        long its batch makes the step, so that its steps stay timed) and
        --decode-prefill-tokens. The step time is its batch's plus its prompt tokens', so
        sizing again from each step converges on the target. Each thread count keeps its own
        size: on shared cores a decode worker's steps go on two threads while the prefill
        worker is free and on one while it computes, at about half the pace, and a size timed
        on the one would make the next step on the other twice the target, or half."""
        target = self.config.decode_step_target_ms / 1000
        if not target or seconds <= 0:
            return
        fit = round(prompt_tokens * target / seconds)
        w.held_step_tokens[threads] = max(MIN_TIMED_PREFILL,
                                          min(self.config.decode_prefill_tokens, fit))

    def to_take_back(self, p: WorkerState) -> TakeBack | None:
        """With --prefill-take-back, the first long prompt a decode worker holds that prefill
        worker p, with none of its own left to compute and no prefix fill under way, would
        finish sooner than that decode worker (see the module's doc), and how: a fill first,
        or the prompt now. None when either pace is unmeasured, the decode worker has planned
        the prompt's last chunk, or p has no room for it."""
        if p.role != "prefill" or not self.config.prefill_take_back or p.leaving or \
                self._partials(p) or not p.prefill_speed.seconds_per_token or \
                p.num_seqs >= self.config.max_num_seqs or self.transfers.filling(p):
            return None
        bs = p.kv.block_size
        for d in self.workers.of_role("decode"):
            for req in self._partials(d):
                if not self._beside_batch(d, req) or (there := self._rest_held(d, req)) is None:
                    continue
                hashes = req.hashes(bs)
                prefix = p.kv.find_prefix(hashes, req.num_tokens)
                fill = self._fillable(d, p, req, len(hashes), len(prefix))
                have = max(p.kv.num_hit_blocks(hashes, req.num_tokens), len(prefix) + fill) * bs
                # the tokens p computes, and once more those d computed that p computes again:
                # the work the move throws away, which delays the prompts p takes next
                here = p.prefill_speed.seconds(
                    req.num_tokens - have + max(0, req.num_computed_tokens - have))
                if here < there * self.config.decode_hold_margin and \
                        p.kv.can_fit(req.request_id, req.num_tokens, prefix):
                    return TakeBack(req, d, tuple(prefix), fill)
        return None

    def _take_back(self, p: WorkerState, back: TakeBack) -> None:
        """A prefix fill into p, or the prompt back to the front of the queue, next in."""
        req = back.request
        if back.fill:
            req.prefix_filled = True
            self.transfers.open_fill(req, back.src, p, len(back.prefix) + back.fill,
                                     list(back.prefix), f"{req.request_id}/fill{self._next_id()}")
            return
        self._requeue(req)
        req.taken_back = True
        self.num_long_taken_back += 1

    def _rest_held(self, d: WorkerState, req: Request) -> float | None:
        """Seconds decode worker d needs for the rest of req, a long prompt it holds: at the
        pace it has gone at on it since it took it (its steps beside its batch, the short
        prompts it took meanwhile), as `_held_seconds` says before it has a pace; None with
        neither."""
        left = req.num_tokens - req.num_computed_tokens
        done, elapsed = req.num_computed_tokens - req.held_from, self._clock() - req.held_at
        if done > 0 and elapsed > 0:
            return left * elapsed / done
        return self._held_seconds(d, left, self._threads(d), shorts=False)

    def _fillable(self, d: WorkerState, p: WorkerState, req: Request, hashed: int,
                  cached: int) -> int:
        """Blocks of req's prompt (`hashed` of them have hashes) that decode worker d has
        computed (planned) past the first `cached`, which a prefix fill could bring to p: none
        when the request had one, scores its prompt (no hashes), p caches no prefixes, or the
        two share no transport or block size."""
        bs = p.kv.block_size
        if req.prefix_filled or not p.kv.pool.enable_caching or d.kv.block_size != bs or \
                not transport_between(d, p):
            return 0
        computed = min(req.num_computed_tokens // bs, hashed)
        return max(0, computed - cached)

    def _admit(self, w: WorkerState, plan: StepPlan, budget: int, completes: bool) -> int:
        """New prompts from the waiting queue while the budget lasts; returns what is left.
        `completes`: the step finishes a prompt started before (see `_try_admit`)."""
        if not self.admits(w):
            return budget
        for req in list(itertools.islice(self.waiting, self.lookahead)):
            if budget <= 0 or w.num_seqs >= self.config.max_num_seqs:
                break
            verdict = self._try_admit(w, plan, req, budget, completes)
            if verdict is None:
                break  # no room anywhere: keep the queue's order
            budget -= verdict
        return budget

    def _partials(self, w: WorkerState) -> list[Request]:
        """w's prompts with tokens still to schedule."""
        return [r for r in w.prefilling
                if r.status is Status.PREFILLING and r.num_computed_tokens < r.num_tokens]

    def has_partial(self, w: WorkerState) -> bool:
        return any(r.status is Status.PREFILLING for r in w.prefilling)

    def _try_admit(self, w: WorkerState, plan: StepPlan, req: Request,
                   budget: int, completes: bool) -> int | None:
        """Starts req on w; returns the tokens it scheduled (0: req skipped, later ones may
        go) or None (stop admitting this step). A long prompt (`_is_long`) that would not
        finish in this step waits for the next one when this step finishes a prompt started
        before: its first chunk would lengthen the step by about its own time, delaying that
        prompt's first token by as much, and gain it little (the step after starts it that much
        sooner; only one step's fixed cost more). Short prompts still fill the step: their
        chunks cost little beside a step's fixed cost (its weight reads)."""
        n = req.num_tokens
        hashes = req.hashes(w.kv.block_size)
        prefix = w.kv.find_prefix(hashes, n)
        in_tier = w.kv.find_tier(hashes, n, len(prefix))
        hit = len(prefix) + len(in_tier)  # blocks not to compute: cached, or loaded from the tier
        todo = n - hit * w.kv.block_size
        if w.role == "decode" and self.workers.has_prefill and not req.prefill_locally and \
                not self._decode_takes(w, req, hashes, todo):
            return 0  # a prefill worker takes it
        if w.role == "prefill" and (req.prefill_locally or self._decoder_holds_more(req, hashes,
                                                                                   todo)):
            return 0  # its decode worker prefills it: no recompute, no KV hop
        if w.role == "prefill" and todo > self.config.prefill_bypass_threshold and any(
                self._takes_beside_shared_cores(d, req, hashes, self._todo(d, req, hashes))
                for d in self.workers.of_role("decode")):
            return 0  # a decode worker sharing its cores takes it beside its batch
        if w.role == "prefill" and self._better_prefill(w, req, hashes, hit):
            return 0  # another prefill worker holds more of its prefix: leave it to that one
        if todo > min(budget, self._chunk_cap()) and ((completes and self._is_long(req)) or
                                                      not self._may_start_partial(w, req)):
            return 0
        dst = dst_prefix = None
        if w.role == "prefill":
            decoders = [d for d in self.workers.of_role("decode")
                        if d.num_seqs < self.config.max_num_seqs and transport_between(w, d)]
            dst = self.placement.choose_decode(req, decoders, n + 1, hashes)
            if dst is None:
                return None
            dst_prefix = dst.kv.find_prefix(hashes, n)
        if w.kv.allocate_slots(req.request_id, n, prefix, in_tier) is None:
            return None
        self.waiting.remove(req)
        req.status = Status.PREFILLING
        req.prefill_worker = w.worker_id
        req.decode_worker = (dst or w).worker_id
        req.num_computed_tokens = hit * w.kv.block_size
        if req.num_cached_tokens is None:  # first admission: the hit the client is told
            req.num_cached_tokens = req.num_computed_tokens
            if w.role == "prefill" and req.hold_declined:
                self.num_long_left += 1  # a decode worker's batch would have lost more
        if self._beside_batch(w, req):
            self.num_long_on_decode += 1
            req.held_at, req.held_from = self._clock(), req.num_computed_tokens
        w.prefilling.append(req)
        if dst is not None:
            self.transfers.open(req, w, dst, dst_prefix or [],
                                f"{req.request_id}/{self._next_id()}")
        w.introduce(plan, req)
        return self._schedule_chunk(w, plan, req, budget)

    def _decoder_holds_more(self, req: Request, hashes: list[bytes], todo: int) -> bool:
        """Whether a decode worker caches more of req than this prefill worker, leaving a
        short tail there: it prefills that tail itself."""
        tails = (self._todo(d, req, hashes) for d in self.workers.of_role("decode"))
        return any(tail <= self.config.prefill_bypass_threshold and tail < todo
                   for tail in tails)

    def _prefill_todo(self, req: Request, hashes: list[bytes]) -> float:
        """The fewest tokens of req any prefill worker would compute (inf with none)."""
        return min((self._todo(p, req, hashes) for p in self.workers.of_role("prefill")),
                   default=float("inf"))

    def _todo(self, w: WorkerState, req: Request, hashes: list[bytes]) -> int:
        """Tokens of req that w would compute: those past its cached prefix and what its tier
        holds after that."""
        return req.num_tokens - w.kv.num_hit_blocks(hashes, req.num_tokens) * w.kv.block_size

    @property
    def long_prefill_token_threshold(self) -> int:
        t = self.config.long_prefill_token_threshold
        if t == 0 and self.config.max_num_partial_prefills > 1:
            # half the step: a long prompt's chunk leaves the other half to short prompts
            t = max(1, self.config.max_num_batched_tokens // 2)
        return t

    def _decode_takes(self, w: WorkerState, req: Request, hashes: list[bytes],
                      todo: int) -> bool:
        """Whether decode worker w prefills req beside its batch (see the module's doc)."""
        partial = self._partials(w)
        if todo <= self.config.prefill_bypass_threshold:
            pending = sum(r.num_tokens - r.num_computed_tokens for r in partial
                          if not self._long_here(r))
            if pending and pending + todo > self.config.decode_prefill_tokens:
                return False  # a step's worth is pending here already: a prefill worker may
                              # be free sooner
            return todo < self._prefill_todo(req, hashes) or \
                not any(map(self._free, self.workers.of_role("prefill")))
        if self._takes_beside_shared_cores(w, req, hashes, todo):
            return True
        if not self.config.saturated_prefill_bypass or any(map(self._long_here, partial)):
            return False
        prefills = self.workers.of_role("prefill")
        if not self._has_room(w, todo) or any(map(self._free, prefills)):
            return False
        there = self._elsewhere_seconds(req, todo, prefills)
        here = self._held_seconds(w, todo, self._threads(w), shorts=True)
        if not self._done_sooner_here(here, there) and not self._newest_at_overload(req):
            return False
        return self._hold_pays(w, req, here, there)

    def _newest_at_overload(self, req: Request) -> bool:
        """Whether req is the newest long prompt in the waiting queue's lookahead while the
        prefill workers' load (`long_load`) is 1 or more: a decode worker that would finish
        none of them sooner than a prefill worker takes this one all the same. Each long
        prompt a prefill worker computes delays every one queued or arriving after it, so the
        decode worker's share of its cores goes to prompts while they keep coming; the older
        ones keep their turn on the prefill worker, and the newest, which would wait there
        longest, takes the slower lane (of two prompts that a decode worker would finish
        after a prefill worker, holding the older one would give it the later first token: its
        wait so far and then the slower lane's time)."""
        rho = self.long_load()
        if rho is None or rho < 1:
            return False
        longs = [r for r in itertools.islice(self.waiting, self.lookahead) if self._long_here(r)]
        return bool(longs) and longs[-1] is req

    def _has_room(self, w: WorkerState, todo: int) -> bool:
        """Whether decode worker w keeps a quarter of its blocks free after a long prompt's."""
        return w.kv.num_free_blocks - w.kv.blocks_for(todo + 1) >= w.kv.num_blocks // 4

    def _takes_beside_shared_cores(self, w: WorkerState, req: Request, hashes: list[bytes],
                                   todo: int) -> bool:
        """--shared-cores-prefill-bypass: whether decode worker w takes req, a long prompt with
        `todo` tokens to compute there, although a prefill worker is free to: one sharing its
        cores, which then lends them all to w (cores.py) while it has nothing to compute; w has
        a batch to step beside the prompt, no long prompt of its own and room, no prefill
        worker caches more of the prompt (it would not compute that part again), and req is not
        one a prefill worker took back from it (--prefill-take-back). The prompt then goes at
        about a prefill worker's pace on every core, beside the batch, where on the prefill
        worker it would get the one core the batch leaves it, and its KV stays put. With every
        such prefill worker busy the cores are split anyway: the saturated bypass decides."""
        prefills = self.workers.of_role("prefill")
        return self.config.shared_cores_prefill_bypass and not req.taken_back \
            and not w.leaving and bool(w.decoding) \
            and todo > self.config.prefill_bypass_threshold \
            and w.num_seqs < self.config.max_num_seqs \
            and not any(map(self._long_here, self._partials(w))) and self._has_room(w, todo) \
            and todo <= self._prefill_todo(req, hashes) \
            and any(shares_cores(w, p) and self._free(p)
                    and self._hold_pays(w, req,
                                        self._held_seconds(w, todo, len(w.cpu_cores), False),
                                        self._on_share_seconds(w, p, todo))
                    for p in prefills)

    def _elsewhere_seconds(self, req: Request, todo: int,
                           prefills: list[WorkerState]) -> float | None:
        """Seconds until the soonest prefill worker would have req's `todo` tokens computed:
        it first finishes what it has started and the longer prompts queued ahead of req, at
        its measured speed (None: no prefill worker's is measured)."""
        ahead = 0
        for r in self.waiting:
            if r is req:
                break
            if r.num_tokens > self.config.prefill_bypass_threshold:
                ahead += r.num_tokens - r.num_computed_tokens
        elsewhere = [p.prefill_speed.seconds(self._backlog(p) + ahead + todo)
                     for p in prefills if p.prefill_speed.seconds_per_token]
        return min(elsewhere) if elsewhere else None

    def _done_sooner_here(self, here: float | None, there: float | None) -> bool:
        """Whether a decode worker, taking `here` seconds for a long prompt beside its batch
        (`_held_seconds`), finishes it in 1/--decode-hold-margin of `there`, the time the
        soonest prefill worker would take. A decode worker prefills in chunks beside its
        batch, slower than a prefill worker, and every request it decodes meanwhile runs at
        --decode-step-target-ms; a prompt it takes stays with it, so it takes one only when
        the prefill workers are far enough behind that the prompt gains much. Unmeasured
        speeds (no step timed yet): it takes it."""
        if here is None or there is None:
            return True
        return here * self.config.decode_hold_margin < there

    def _held_seconds(self, w: WorkerState, todo: int, threads: int,
                      shorts: bool) -> float | None:
        """Seconds decode worker w would take for `todo` tokens of a long prompt beside its
        batch, its steps on `threads` threads: they compute a prompt token in the time measured
        on as many (its batch stepping beside it) in its steps beside the long prompts it held,
        over about a long prompt's tokens (`WorkerState.held_speed`; before it held one: in any
        step with prompt tokens, which a batch that then carried a few short prompts makes look
        slower). With `shorts` (every prefill worker busy), the short prompts that arrive
        meanwhile (`short_load`) go first in its steps, so the long prompt gets the pace they
        leave (inf where they would leave it none); while a prefill worker is free they go to
        that one. None while w's speed is unmeasured."""
        if not (per_token := w.held_speed.on(threads) or w.prefill_speed.on(threads)):
            return None
        pace = 1 / per_token - (self.short_load().tokens_per_s if shorts else 0.0)
        return todo / pace if pace > 0 else math.inf

    def _on_share_seconds(self, w: WorkerState, p: WorkerState, todo: int) -> float | None:
        """Seconds prefill worker p, sharing decode worker w's cores, would take for `todo`
        prompt tokens in its chunks: a chunk that starts while w's batch lives (the most tokens
        any of its requests has left, at w's decode step time) runs on p's share of the cores
        (a step keeps the threads it was planned with). A later one runs there too if short
        prompts arriving since keep a batch stepping: with `short_load`'s requests a second,
        each stepping its tokens at that step time, a batch is there a fraction
        1 - e^(-rate * their time) of the time (as many requests as arrive in that time,
        Poisson), and the chunk runs on all of p's cores for the rest. None while p's speed is
        unmeasured."""
        alone = p.prefill_speed.on(len(p.cpu_cores))
        if not alone:
            return None
        share = threads_for(p, (w,), lambda _: True)
        shared = p.prefill_speed.by_threads.get(share) or \
            alone * len(p.cpu_cores) / max(1, share)
        lives = max(map(self._tokens_left, w.decoding), default=0) * w.decode_step_seconds
        short = self.short_load()
        busy = 1 - math.exp(-short.rate * short.mean_tokens * w.decode_step_seconds)
        later = busy * shared + (1 - busy) * alone
        chunk = min(self._chunk_cap(), self.config.max_num_batched_tokens)
        seconds = 0.0
        for start in range(0, todo, chunk):
            seconds += min(chunk, todo - start) * (shared if seconds < lives else later)
        return seconds

    def _tokens_left(self, req: Request) -> int:
        """The most tokens a decoding request has still to produce."""
        return max(0, min(req.max_tokens - len(req.output_token_ids),
                          self.workers.max_model_len - req.num_tokens))

    def _hold_pays(self, w: WorkerState, req: Request, here: float | None,
                   there: float | None) -> bool:
        """Whether decode worker w holding req gains more than its batch loses, with `here` the
        seconds w would take for it beside its batch (`_held_seconds`) and `there` those a
        prefill worker would take instead. Each request w decodes steps at
        --decode-step-target-ms until the prompt is done, or until it has no tokens left, and
        so does each short request arriving meanwhile (`short_load`): the batch loses what
        that takes them past their TPOT budgets, or with --tpot-slo-ms 0 the sum of those
        times (`_past_slo`). The prompt gains there - here, and so do the long
        prompts arriving meanwhile, which find the prefill workers that much sooner free: at a
        load rho of those workers (`long_load`) they add about rho / (1 - rho) times as much
        (a busy period's arrivals), so the hold pays when loss * (1 - rho) < there - here, and
        always at rho >= 1. It never pays where the short prompts would leave the long one no
        pace (`here` inf). Unmeasured paces, or no step target, or --no-price-holds: it pays
        (the hold as before). The terms and the verdict go on the request (its placement
        span); a prompt it did not pay for when a prefill worker starts it counts in
        num_long_left."""
        if not self.config.price_holds:
            return True
        target = self.config.decode_step_target_ms / 1000
        rho = self.long_load()
        if not target or not here or there is None or rho is None:
            return True
        if math.isinf(here):
            return self._declined(req)
        loss = self._past_slo(w, target, here, self.short_load())
        req.hold_terms = (loss, here, there - here, rho)
        if rho >= 1 or loss * (1 - rho) < there - here:
            req.hold_declined = False
            return True
        return self._declined(req)

    def _past_slo(self, w: WorkerState, target: float, here: float, short: ShortLoad) -> float:
        """Seconds a hold of `here` seconds takes decode worker w's requests past their TPOT
        budgets (--tpot-slo-ms times the tokens after their first): each steps at `target`
        instead of w's decode step time while held, until the prompt is done or its own tokens
        are, and would then go on at that step time; it counts only what the hold adds beyond
        its budget, given the time it has already spent since its first token. The short
        requests arriving meanwhile (`short_load`) count the same way, from their first
        token. With --tpot-slo-ms 0 no budget is left to anyone and every second held counts
        whole: the seconds the requests step held."""
        slo, step = self.config.tpot_slo_ms / 1000, w.decode_step_seconds
        # of a second stepped held, what a request loses
        slow = max(0.0, 1 - step / target) if slo else 1.0
        now, loss = self._clock(), 0.0
        for r in w.decoding:
            left = self._tokens_left(r)
            after_first = len(r.output_token_ids) + left - 1
            if after_first < 1:
                continue
            spent = now - r.first_token_at if r.first_token_at is not None else 0.0
            over = spent + left * step - slo * after_first  # past its budget without the hold
            held = min(left * target, here) * slow
            loss += max(0.0, over + held) - max(0.0, over)
        m = short.mean_tokens
        slack = max(0.0, slo * (m - 1) - m * step)
        return loss + short.rate * _past_beside(m * target, here, slow, slack)

    @staticmethod
    def _declined(req: Request) -> bool:
        """A hold declined (False), as last priced: should a prefill worker start req, it
        counts in num_long_left (`_try_admit`)."""
        req.hold_declined = True
        return False

    def short_load(self) -> ShortLoad:
        """The short prompts that arrived in the last LOAD_WINDOW_S seconds, a second and per
        decode worker (they prefill and decode there), and the mean of the tokens each
        generates at most."""
        self._forget_old_arrivals()
        arrivals = self._short_arrivals
        if not arrivals:
            return ShortLoad()
        per_second = LOAD_WINDOW_S * max(1, len(self.workers.of_role("decode")))
        return ShortLoad(len(arrivals) / per_second, sum(n for _, n, _ in arrivals) / per_second,
                         sum(m for _, _, m in arrivals) / len(arrivals))

    def long_load(self) -> float | None:
        """The prefill workers' load from long prompts: the prompt tokens of those that arrived
        in the last LOAD_WINDOW_S seconds, at the prefill workers' measured speed on all their
        cores, over LOAD_WINDOW_S and their number (1: they arrive as fast as the prefill
        workers compute them alone). None while no prefill worker's speed is measured."""
        self._forget_old_arrivals()
        if not (alone := self._alone()):
            return None
        tokens = sum(n for _, n in self._long_arrivals)
        return tokens * alone / LOAD_WINDOW_S / len(self.workers.of_role("prefill"))

    def _alone(self) -> float:
        """Seconds per prompt token of the prefill workers on all their cores, the mean of
        those measured (0: none is)."""
        speeds = [s for p in self.workers.of_role("prefill")
                  if (s := p.prefill_speed.on(len(p.cpu_cores)))]
        return sum(speeds) / len(speeds) if speeds else 0.0

    def _backlog(self, p: WorkerState) -> int:
        """Prompt tokens prefill worker p has started and not computed yet: in its steps
        running now and in the chunks of its partial prefills still to plan."""
        return sum(s.prefill_tokens for s in p.steps) + \
            sum(r.num_tokens - r.num_computed_tokens for r in self._partials(p))

    def _long_here(self, req: Request) -> bool:
        """A prompt a decode worker took because the prefill workers were saturated: more
        uncached tokens than --prefill-bypass-threshold. It goes in chunks sized to
        --decode-step-target-ms (`held_tokens`), one such prompt at a time."""
        return req.num_tokens - (req.num_cached_tokens or 0) > self.config.prefill_bypass_threshold

    def _beside_batch(self, w: WorkerState, req: Request) -> bool:
        """Whether req is such a long prompt on decode worker w, beside its batch."""
        return w.role == "decode" and self.workers.has_prefill and self._long_here(req)

    def _free(self, p: WorkerState) -> bool:
        """A prefill worker that could start a prompt now: no step running, none partial."""
        return p.is_idle and p.num_seqs < self.config.max_num_seqs and not self.has_partial(p)

    def _better_prefill(self, w: WorkerState, req: Request, hashes: list[bytes],
                        hit: int) -> bool:
        """Whether another prefill worker holds a longer prefix of req (cached, or in its tier
        after that) and can start it."""
        for other in self.workers.of_role("prefill"):
            if other is w or other.num_seqs >= self.config.max_num_seqs:
                continue
            prefix = other.kv.find_prefix(hashes, req.num_tokens)
            if other.kv.num_hit_blocks(hashes, req.num_tokens) > hit and \
                    other.kv.can_fit(req.request_id, req.num_tokens, prefix):
                return True
        return False

    def _chunk_cap(self) -> int:
        """Most tokens of one prompt in one step: long prompts are capped when several partial
        prefills share a step, so that none of them takes the whole budget."""
        if self.config.max_num_partial_prefills > 1:
            return self.long_prefill_token_threshold
        return self.workers.max_model_len

    def _is_long(self, req: Request) -> bool:
        t = self.long_prefill_token_threshold
        return t > 0 and req.num_tokens > t

    def _may_start_partial(self, w: WorkerState, req: Request) -> bool:
        partial = self._partials(w)
        if len(partial) >= self.config.max_num_partial_prefills:
            return False
        if self._is_long(req):
            return sum(map(self._is_long, partial)) < self.config.max_long_partial_prefills
        return True

    def _schedule_chunk(self, w: WorkerState, plan: StepPlan, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget, self._chunk_cap())
        if self._beside_batch(w, req):
            n = min(n, self.held_tokens(w))
        plan.scheduled.append(ScheduledTokens(req.request_id, n))
        req.num_computed_tokens += n
        w.cache(req, req.num_computed_tokens)
        if req.num_computed_tokens == req.num_tokens and req.transfer_id:
            self.transfers.computed(plan, req)
        return n
