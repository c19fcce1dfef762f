"""protos/worker.proto <-> the dataclasses of common/plans.py: the scheduler <-> worker boundary.
Each direction is lossless: x == from_pb(to_pb(x)) for every message."""
from __future__ import annotations

from common.kv_layout import KVLayout
from common.plans import (
    BlockCopy,
    CachedRequest,
    Fork,
    KVRecv,
    KVSend,
    NewRequest,
    PromptLogprobs,
    Registration,
    RequestError,
    SampledToken,
    ScheduledTokens,
    StepPlan,
    StepResult,
    TransferDone,
    TransfersDone,
    WorkerCounters,
)
from protos import worker_pb2
from protos.scheduler_codec import (
    logprobs_from_pb,
    logprobs_to_pb,
    sampling_from_pb,
    sampling_to_pb,
)


def layout_to_pb(layout: KVLayout) -> worker_pb2.KVLayout:
    return worker_pb2.KVLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                               head_dim=layout.head_dim, block_size=layout.block_size,
                               dtype=layout.dtype,
                               tensor_parallel_size=layout.tensor_parallel_size,
                               pipeline_parallel_size=layout.pipeline_parallel_size)


def layout_from_pb(pb: worker_pb2.KVLayout) -> KVLayout:
    return KVLayout(pb.num_layers, pb.num_kv_heads, pb.head_dim, pb.block_size, pb.dtype,
                    max(1, pb.tensor_parallel_size), max(1, pb.pipeline_parallel_size))


def registration_to_pb(r: Registration) -> worker_pb2.Register:
    first = r.kv_endpoints.get(r.transports[0], "") if r.transports else ""
    return worker_pb2.Register(
        worker_id=r.worker_id, role=r.role, model_fingerprint=r.model_fingerprint,
        num_blocks=r.num_blocks, layout=layout_to_pb(r.layout), kv_endpoint=first,
        transports=r.transports, host_id=r.host_id, max_model_len=r.max_model_len,
        kv_endpoints=r.kv_endpoints, cpu_cores=r.cpu_cores,
        num_speculative_tokens=r.num_speculative_tokens, num_tier_blocks=r.num_tier_blocks,
        tier_id=r.tier_id,
        cached_blocks=[worker_pb2.CachedBlock(block_id=b, hash=h) for b, h in r.cached_blocks])


def registration_from_pb(pb: worker_pb2.Register) -> Registration:
    # a worker that names one endpoint only offers it for every transport
    endpoints = dict(pb.kv_endpoints) or {t: pb.kv_endpoint for t in pb.transports}
    return Registration(
        worker_id=pb.worker_id, role=pb.role, model_fingerprint=pb.model_fingerprint,
        num_blocks=pb.num_blocks, layout=layout_from_pb(pb.layout),
        transports=tuple(pb.transports), kv_endpoints=endpoints, host_id=pb.host_id,
        max_model_len=pb.max_model_len, cpu_cores=tuple(pb.cpu_cores),
        num_speculative_tokens=pb.num_speculative_tokens, num_tier_blocks=pb.num_tier_blocks,
        tier_id=pb.tier_id,
        cached_blocks=tuple((c.block_id, c.hash) for c in pb.cached_blocks))


def plan_to_pb(plan: StepPlan) -> worker_pb2.StepPlan:
    pb = worker_pb2.StepPlan(step_id=plan.step_id, num_threads=plan.num_threads,
                             num_steps=plan.num_steps,
                             finished_request_ids=plan.finished_request_ids,
                             cached_blocks=[worker_pb2.CachedBlock(block_id=b, hash=h)
                                            for b, h in plan.cached_blocks],
                             tier_stores=[worker_pb2.TierCopy(block=b, slot=t)
                                          for b, t in plan.tier_stores],
                             tier_loads=[worker_pb2.TierCopy(block=b, slot=t)
                                         for t, b in plan.tier_loads],
                             tier_stores_ahead=[worker_pb2.TierCopy(block=b, slot=t)
                                                for b, t in plan.tier_stores_ahead])
    for n in plan.new_requests:
        pb.new_requests.add(
            request_id=n.request_id, all_token_ids=n.all_token_ids,
            num_prompt_tokens=n.num_prompt_tokens, num_computed_tokens=n.num_computed_tokens,
            block_ids=n.block_ids, sampling=sampling_to_pb(n.sampling),
            kv_transfer_id=n.kv_transfer_id, eos_token_ids=n.eos_token_ids,
            trace_context=n.trace_context,
            forks=[worker_pb2.Fork(request_id=f.request_id, sampling=sampling_to_pb(f.sampling))
                   for f in n.forks])
    for c in plan.cached_requests:
        pb.cached_requests.add(request_id=c.request_id, new_block_ids=c.new_block_ids,
                               new_token_ids=c.new_token_ids)
    for s in plan.scheduled:
        pb.scheduled.add(request_id=s.request_id, num_tokens=s.num_tokens,
                         num_lookahead=s.num_lookahead)
    for k in plan.sends:
        pb.sends.add(transfer_id=k.transfer_id, request_id=k.request_id,
                     src_block_ids=k.src_block_ids, dst_block_ids=k.dst_block_ids,
                     dst_endpoint=k.dst_endpoint, transport=k.transport)
    for r in plan.recvs:
        pb.recvs.add(transfer_id=r.transfer_id, request_id=r.request_id, block_ids=r.block_ids,
                     transport=r.transport)
    for b in plan.copies:
        pb.copies.add(src=b.src, dst=b.dst, request_id=b.request_id, leader_id=b.leader_id)
    return pb


def plan_from_pb(pb: worker_pb2.StepPlan) -> StepPlan:
    return StepPlan(
        step_id=pb.step_id,
        new_requests=[NewRequest(
            request_id=n.request_id, all_token_ids=tuple(n.all_token_ids),
            num_prompt_tokens=n.num_prompt_tokens, num_computed_tokens=n.num_computed_tokens,
            block_ids=tuple(n.block_ids), sampling=sampling_from_pb(n.sampling),
            eos_token_ids=tuple(n.eos_token_ids), kv_transfer_id=n.kv_transfer_id,
            forks=tuple(Fork(f.request_id, sampling_from_pb(f.sampling)) for f in n.forks),
            trace_context=dict(n.trace_context)) for n in pb.new_requests],
        cached_requests=[CachedRequest(c.request_id, tuple(c.new_block_ids),
                                       tuple(c.new_token_ids)) for c in pb.cached_requests],
        scheduled=[ScheduledTokens(s.request_id, s.num_tokens, s.num_lookahead)
                   for s in pb.scheduled],
        sends=[KVSend(k.transfer_id, k.request_id, tuple(k.src_block_ids),
                      tuple(k.dst_block_ids), k.dst_endpoint, k.transport) for k in pb.sends],
        recvs=[KVRecv(r.transfer_id, r.request_id, tuple(r.block_ids), r.transport)
               for r in pb.recvs],
        finished_request_ids=list(pb.finished_request_ids),
        copies=[BlockCopy(b.src, b.dst, b.request_id, b.leader_id) for b in pb.copies],
        num_threads=pb.num_threads, num_steps=max(1, pb.num_steps),
        cached_blocks=[(c.block_id, c.hash) for c in pb.cached_blocks],
        tier_stores=[(c.block, c.slot) for c in pb.tier_stores],
        tier_loads=[(c.slot, c.block) for c in pb.tier_loads],
        tier_stores_ahead=[(c.block, c.slot) for c in pb.tier_stores_ahead])


def counters_to_pb(c: WorkerCounters) -> worker_pb2.WorkerCounters:
    return worker_pb2.WorkerCounters(
        prompt_tokens_computed=c.prompt_tokens_computed, tokens_decoded=c.tokens_decoded,
        kv_blocks_sent=c.kv_blocks_sent, kv_blocks_received=c.kv_blocks_received,
        steps=c.steps, spec_drafts=c.spec_drafts, spec_draft_tokens=c.spec_draft_tokens,
        spec_accepted_tokens=c.spec_accepted_tokens,
        spec_accepted_per_pos=c.spec_accepted_per_pos, kv_frames_rejected=c.kv_frames_rejected,
        tier_blocks_stored=c.tier_blocks_stored, tier_blocks_loaded=c.tier_blocks_loaded,
        kv_bytes_sent_per_rank=c.kv_bytes_sent_per_rank)


def counters_from_pb(pb: worker_pb2.WorkerCounters) -> WorkerCounters:
    return WorkerCounters(pb.prompt_tokens_computed, pb.tokens_decoded, pb.kv_blocks_sent,
                          pb.kv_blocks_received, pb.steps, pb.spec_drafts, pb.spec_draft_tokens,
                          pb.spec_accepted_tokens, tuple(pb.spec_accepted_per_pos),
                          pb.kv_frames_rejected, pb.tier_blocks_stored, pb.tier_blocks_loaded,
                          tuple(pb.kv_bytes_sent_per_rank))


def result_to_pb(r: StepResult) -> worker_pb2.StepResult:
    pb = worker_pb2.StepResult(step_id=r.step_id, counters=counters_to_pb(r.counters),
                               more=r.more)
    for s in r.sampled:
        t = pb.sampled.add(request_id=s.request_id, token_id=s.token_id)
        if s.logprobs is not None:
            t.logprobs.CopyFrom(logprobs_to_pb(s.logprobs))
    for e in r.errors:
        pb.errors.add(request_id=e.request_id, error=e.error)
    for p in r.prompt_logprobs:
        pb.prompt_logprobs.add(request_id=p.request_id, start=p.start,
                               logprobs=[logprobs_to_pb(lp) for lp in p.logprobs])
    return pb


def result_from_pb(pb: worker_pb2.StepResult) -> StepResult:
    return StepResult(
        step_id=pb.step_id,
        sampled=tuple(SampledToken(s.request_id, s.token_id,
                                   logprobs_from_pb(s.logprobs) if s.HasField("logprobs")
                                   else None) for s in pb.sampled),
        errors=tuple(RequestError(e.request_id, e.error) for e in pb.errors),
        counters=counters_from_pb(pb.counters),
        prompt_logprobs=tuple(
            PromptLogprobs(p.request_id, p.start, tuple(map(logprobs_from_pb, p.logprobs)))
            for p in pb.prompt_logprobs),
        more=pb.more)


def transfers_done_to_pb(t: TransfersDone) -> worker_pb2.TransfersDone:
    return worker_pb2.TransfersDone(
        done=[worker_pb2.TransferDone(transfer_id=d.transfer_id, error=d.error) for d in t.done],
        counters=counters_to_pb(t.counters))


def transfers_done_from_pb(pb: worker_pb2.TransfersDone) -> TransfersDone:
    return TransfersDone(tuple(TransferDone(d.transfer_id, d.error) for d in pb.done),
                         counters_from_pb(pb.counters))
