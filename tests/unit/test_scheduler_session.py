"""The scheduler's Session writer: what gathers between two writes goes out in as few messages
as fit under SESSION_MESSAGE_BYTES, in the order it came."""
import asyncio

import grpc

from common.grpc_options import MAX_MESSAGE_BYTES
from protos import scheduler_pb2
from services.scheduler.server import SESSION_MESSAGE_BYTES, _Session


def _out(rid: str, padding: int = 0) -> scheduler_pb2.GenerateResponse:
    return scheduler_pb2.GenerateResponse(request_id=rid, token_ids=[1], error="x" * padding)


def _session() -> _Session:
    async def make() -> _Session:  # its Event wants a loop
        return _Session()
    return asyncio.run(make())


def test_a_steps_outputs_go_in_one_message_and_refusals_after_them() -> None:
    s = _session()
    for i in range(60):
        s.send(_out(f"r{i}"))
    s.refuse("bad", grpc.StatusCode.INVALID_ARGUMENT, "no")
    messages = s.take()
    assert [[o.request_id for o in m.outputs] for m in messages] == [
        [f"r{i}" for i in range(60)], []]
    assert [(r.request_id, r.code) for r in messages[1].refused] == [
        ("bad", grpc.StatusCode.INVALID_ARGUMENT.value[0])]
    assert s.take() == [] and not s.pending and not s.refused


def test_large_outputs_split_the_messages_in_order_each_under_the_cap() -> None:
    s = _session()
    third = SESSION_MESSAGE_BYTES // 3
    sizes = [third, third, 10, third, 2 * SESSION_MESSAGE_BYTES, 10]
    for i, n in enumerate(sizes):
        s.send(_out(f"r{i}", n))
    messages = s.take()
    assert [[o.request_id for o in m.outputs] for m in messages] == [
        ["r0", "r1", "r2"], ["r3"], ["r4"], ["r5"]]
    # only an output larger than the cap makes a larger message, alone
    assert [m.ByteSize() <= SESSION_MESSAGE_BYTES for m in messages] == [True, True, False, True]
    assert SESSION_MESSAGE_BYTES < MAX_MESSAGE_BYTES  # so that a gathered message always fits
