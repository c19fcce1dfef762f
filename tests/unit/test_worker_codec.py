"""The scheduler <-> worker codec (protos/worker_codec.py): every message survives the wire
unchanged, the optional fields included, and registrations from workers that name one endpoint
offer it for every transport."""
from common.kv_layout import KVLayout
from common.plans import (BlockCopy, CachedRequest, Fork, KVRecv, KVSend, NewRequest,
                          PromptLogprobs, Registration, RequestError, SampledToken,
                          ScheduledTokens, StepPlan, StepResult, TransferDone, TransfersDone,
                          WorkerCounters)
from common.sampling_params import SamplingParams, TokenLogprobs, TopLogprob
from protos import worker_pb2
from protos.worker_codec import (plan_from_pb, plan_to_pb, registration_from_pb,
                                 registration_to_pb, result_from_pb, result_to_pb,
                                 transfers_done_from_pb, transfers_done_to_pb)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")


def test_a_full_plan_round_trips():
    seeded = SamplingParams(max_tokens=9, temperature=0.5, seed=2**64 - 1, logprobs=3,
                            stop_token_ids=(5, 6), prompt_logprobs=2,
                            logit_bias=((1, -100.0), (6, 2.5)))
    plan = StepPlan(
        step_id=2**40,
        new_requests=[
            NewRequest("a", (1, 2, 3), 2, 0, (7, 8), seeded, eos_token_ids=(2,),
                       forks=(Fork("a/1", seeded.for_sample(1)),),
                       trace_context={"traceparent": "00-ab-cd-01"}),
            NewRequest("b", (4,), 1, 0, (9,), SamplingParams(max_tokens=1),
                       kv_transfer_id="b/3")],
        cached_requests=[CachedRequest("c", (10, 11), (42,)), CachedRequest("d")],
        scheduled=[ScheduledTokens("a", 3), ScheduledTokens("c", 1)],
        sends=[KVSend("t", "a", (7, 8), (1, 2), "tcp://h:1", "tcp")],
        recvs=[KVRecv("u", "e", (3, 4), "shm")],
        finished_request_ids=["x", "y"],
        copies=[BlockCopy(src=8, dst=12, request_id="a/1", leader_id="a")],
        num_threads=3, tier_stores=[(5, 0), (6, 9)], tier_loads=[(9, 7)],
        tier_stores_ahead=[(2, 4)])
    back = plan_from_pb(worker_pb2.StepPlan.FromString(plan_to_pb(plan).SerializeToString()))
    assert back == plan
    assert plan_from_pb(plan_to_pb(StepPlan(0))) == StepPlan(0)


def test_results_and_transfer_reports_round_trip():
    counters = WorkerCounters(100, 20, 7, 5, 33, tier_blocks_stored=4, tier_blocks_loaded=2)
    result = StepResult(
        step_id=9,
        sampled=(SampledToken("a", 5), SampledToken("b", 6, TokenLogprobs(
            -0.5, (TopLogprob(6, -0.5), TopLogprob(1, -1.25))))),
        errors=(RequestError("c", "its KV never landed"),), counters=counters,
        prompt_logprobs=(
            PromptLogprobs("a", 1, (TokenLogprobs(-0.75, (TopLogprob(2, -0.5),), rank=2),
                                    TokenLogprobs(-0.125, (), rank=1))),
            PromptLogprobs("d", 17, (TokenLogprobs(-3.0, rank=9),))))
    assert result_from_pb(result_to_pb(result)) == result
    done = TransfersDone((TransferDone("t"), TransferDone("u", "connection reset")), counters)
    assert transfers_done_from_pb(transfers_done_to_pb(done)) == done


def test_registrations_round_trip_and_one_endpoint_serves_every_transport():
    reg = Registration("w", "decode", "fp", 128, LAYOUT, ("shm", "tcp"),
                       {"shm": "shm://w", "tcp": "tcp://h:2"}, host_id="h", max_model_len=4096,
                       cpu_cores=(0, 2, 3), num_tier_blocks=640)
    pb = registration_to_pb(reg)
    assert pb.kv_endpoint == "shm://w"  # the preferred transport's, for older readers
    assert registration_from_pb(pb) == reg
    del pb.kv_endpoints["shm"], pb.kv_endpoints["tcp"]
    assert registration_from_pb(pb).kv_endpoints == {"shm": "shm://w", "tcp": "shm://w"}


def test_a_worker_groups_shape_travels_with_its_layout():
    group = KVLayout(4, 2, 16, 16, "bfloat16", tensor_parallel_size=2, pipeline_parallel_size=2)
    reg = Registration("g", "prefill", "fp", 64, group, ("shm",), {"shm": "shm://a,shm://b"})
    assert registration_from_pb(registration_to_pb(reg)).layout == group
    pb = registration_to_pb(reg)
    pb.layout.ClearField("tensor_parallel_size")  # a writer that predates groups: one rank
    pb.layout.ClearField("pipeline_parallel_size")
    assert registration_from_pb(pb).layout == group.model_layout()
