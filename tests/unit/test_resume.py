"""A request resubmitted after its scheduler was lost: what the gateway sends (each sample's
streamed tokens, whether it finished or its reader closed it), when it sends it (a scheduler
that serves, before the deadline; an old one that still holds the ids aborts them first), and
what a new scheduler makes of it."""
import asyncio
from contextlib import aclosing

import grpc
import pytest

from common.sampling_params import ResumedSample, SamplingParams
from protos import scheduler_pb2
from protos.scheduler_codec import request_from_pb
from services.gateway.scheduler_client import SampleStreams, resubmission
from services.scheduler.request import Request, resume


def samples(n: int, max_tokens: int = 8) -> list[Request]:
    return [Request(f"r{j}", [1, 2, 3], SamplingParams(max_tokens=max_tokens, seed=7 + j), [0])
            for j in range(n)]


def test_the_resubmission_carries_each_samples_tokens_and_nothing_else_changes():
    first = scheduler_pb2.GenerateRequest(
        request_id="r0", prompt_token_ids=[1, 2, 3], sample_ids=["r1", "r2"],
        sampling=scheduler_pb2.SamplingParams(max_tokens=8, seed=7))
    again = resubmission(first, [[5, 6], [], [9]], [False, False, True])
    assert [(s.sample, list(s.output_token_ids), s.finished) for s in again.resumed] == [
        (0, [5, 6], False), (2, [9], True)]
    del again.resumed[:]
    assert again == first
    twice = resubmission(resubmission(first, [[5], [], []], [False] * 3), [[5, 6], [], []],
                         [False] * 3)
    assert [list(s.output_token_ids) for s in twice.resumed] == [[5, 6]]  # the latest only
    assert request_from_pb(twice).resumed == (ResumedSample(0, (5, 6), False),)


def test_resume_drops_finished_samples_and_gives_the_others_their_tokens():
    out = resume(samples(3), [ResumedSample(0, (5, 6)), ResumedSample(2, (9,), True)])
    assert [(r.request_id, r.output_token_ids, r.sampling.seed) for r in out] == [
        ("r0", [5, 6], 7), ("r1", [], 8)]
    untouched = resume(samples(2), [])
    assert [(r.request_id, r.output_token_ids) for r in untouched] == [("r0", []), ("r1", [])]


@pytest.mark.parametrize("resumed", [
    [ResumedSample(3, (1,))],                          # no such sample
    [ResumedSample(0, (1,)), ResumedSample(0, (2,))],  # twice
    [ResumedSample(1, tuple(range(8)))],               # max_tokens reached: finished
])
def test_a_resume_that_does_not_fit_the_request_is_refused(resumed):
    with pytest.raises(ValueError):
        resume(samples(2), resumed)


class Readiness:
    def __init__(self, serving: bool = True):
        self.serving = serving

    async def wait_serving(self, timeout_s: float) -> bool:
        return self.serving and timeout_s > 0


class Scripted:
    """A SchedulerClient whose Generate calls follow a script: per call, the responses it
    yields, then the status it fails with (None: it ends)."""

    def __init__(self, script, recovery_s: float = 5.0, serving: bool = True):
        self.script = list(script)
        self.recovery_s = recovery_s
        self.readiness = Readiness(serving)
        self.calls: list[scheduler_pb2.GenerateRequest] = []
        self.aborted: list[str] = []

    async def generate(self, request, span=None):
        self.calls.append(request)
        responses, status = self.script.pop(0)
        for r in responses:
            yield r
        if status is not None:
            raise grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), "lost")

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


def out(sample: int, *ids: int, finish: str = "") -> scheduler_pb2.GenerateResponse:
    return scheduler_pb2.GenerateResponse(token_ids=ids, sample=sample, finish_reason=finish)


def read_all(client, request, samples: int, close_after: dict[int, int] | None = None):
    """Every sample's streamed token ids, or the exception its stream raised."""

    async def one(streams, j):
        got = []
        try:
            async with aclosing(streams.stream(j)) as responses:
                async for r in responses:
                    got += r.token_ids
                    if close_after and len(got) >= close_after.get(j, 1 << 30):
                        return got  # the reader closes it (a stop string)
        except Exception as e:  # noqa: BLE001 - the stream's error is the result
            return e
        return got

    async def main():
        streams = SampleStreams(client, request)
        return await asyncio.gather(*(one(streams, j) for j in range(samples)))
    return asyncio.run(main())


REQUEST = scheduler_pb2.GenerateRequest(request_id="r0", sample_ids=["r1"],
                                        prompt_token_ids=[1, 2, 3])


@pytest.mark.parametrize("lost", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_lost_scheduler_is_resubmitted_with_the_tokens_streamed_and_the_stream_goes_on(lost):
    """Lost: the connection failed, or a scheduler that stops cancelled the stream after its
    grace period."""
    client = Scripted([
        ([out(0, 5), out(1, 7), out(1, 8, finish="stop")], lost),
        ([], grpc.StatusCode.ALREADY_EXISTS),  # the old scheduler still holds the ids
        ([out(0, 6, finish="length")], None)])
    assert read_all(client, REQUEST, 2) == [[5, 6], [7, 8]]
    assert client.aborted == ["r0"]  # the unfinished sample, before the last try
    last = client.calls[-1]
    assert [(s.sample, list(s.output_token_ids), s.finished) for s in last.resumed] == [
        (0, [5], False), (1, [7, 8], True)]


def test_a_sample_its_reader_closed_is_not_run_again():
    client = Scripted([([out(0, 5), out(1, 7)], grpc.StatusCode.UNAVAILABLE),
                       ([out(0, 6, finish="stop")], None)])
    assert read_all(client, REQUEST, 2, close_after={1: 1}) == [[5, 6], [7]]
    assert [(s.sample, s.finished) for s in client.calls[-1].resumed] == [(0, False), (1, True)]


def test_no_scheduler_in_time_fails_every_stream():
    client = Scripted([([out(0, 5)], grpc.StatusCode.UNAVAILABLE)], serving=False)
    got = read_all(client, REQUEST, 2)
    assert all(isinstance(g, grpc.aio.AioRpcError) for g in got)
    assert len(client.calls) == 1
    other = Scripted([([], grpc.StatusCode.INVALID_ARGUMENT)])  # not a lost scheduler
    assert all(isinstance(g, grpc.aio.AioRpcError) for g in read_all(other, REQUEST, 2))
