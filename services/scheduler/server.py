"""The scheduler's gRPC I/O: Generate/Abort/Stats for gateways, Attach for workers, and the
standard health service (common/health.py), whose statuses follow the workers as they attach
and leave.

All policy lives in scheduler.py; this file only moves messages. One task per attached worker
loops: plan when the worker is idle and has work, send, await the result (with a deadline),
apply it, fan the outputs out to the requests' streams: a Generate call's own stream, or the
Session stream of the gateway that sent the request, where the outputs of one step for all its
requests go out as one message.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable

import grpc

from common import tracing
from common.grpc_options import server_options, written
from common.health import Health
from common.plans import StepPlan
from common.sampling_params import GenerateOutput
from common.tls import grpc_server_credentials, peer_role, warn_if_exposed
from protos import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from protos.scheduler_codec import output_to_pb, request_from_pb
from protos.worker_codec import (
    plan_to_pb,
    registration_from_pb,
    result_from_pb,
    transfers_done_from_pb,
)
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Output, Request, resume
from services.scheduler.scheduler import ProtocolError, QueueFull, RegistrationError, Scheduler
from services.scheduler.telemetry import SchedulerTelemetry

log = logging.getLogger(__name__)

IDLE_POLL_S = 5.0
SESSION_MESSAGE_BYTES = 4 << 20  # a Session message gathers outputs up to this size
TRACED_METHODS = ("Generate", "Abort")  # not Attach: one span as long as a worker's life
API_SERVICE = "pdserve.scheduler.Scheduler"  # health: SERVING while the process serves its API
PREFILL_SERVICE = "pdserve.prefill"  # health: a prefill worker can hand KV to a decode worker
DECODE_SERVICE = "pdserve.decode"    # health: a decode worker is attached
# under TLS, the certificate roles (common/tls.py) each method answers
GATEWAY_ROLES = ("gateway",)
STATS_ROLES = ("gateway", "admin")
WORKER_ROLES = ("worker",)


class Refused(Exception):
    """A request not started: the status a Generate call ends with, a Session's Refusal."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer, worker_pb2_grpc.WorkerControlServicer):
    def __init__(self, config: SchedulerConfig, health: Health):
        self.config = config
        self.scheduler = Scheduler(config)
        self.health = health
        self.telemetry = SchedulerTelemetry(self.scheduler)
        # where each running request's outputs go: a Generate call's queue, or its Session
        self._streams: dict[str, asyncio.Queue[Output] | _SessionRequest] = {}
        self._wake: dict[str, asyncio.Event] = {}

    def _wake_all(self) -> None:
        for ev in self._wake.values():
            ev.set()

    async def update_health(self) -> None:
        """The health service "" is SERVING only while a request can run to its end."""
        workers = self.scheduler.workers
        await self.health.set("", workers.can_serve)
        await self.health.set(PREFILL_SERVICE, workers.has_disaggregated_path)
        await self.health.set(DECODE_SERVICE, workers.can_serve)

    def _dispatch(self, outputs: list[Output]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    # ---- gateway side --------------------------------------------------------------------------

    async def _authorize(self, context, roles: tuple[str, ...]) -> None:
        """Under TLS, a caller whose certificate's role may not call this method is refused
        (PERMISSION_DENIED); in the clear every caller may."""
        if self.config.tls is None:
            return
        role = peer_role(context)
        if role not in roles:
            log.warning("refused a call from a %r certificate (%s); it takes %s", role,
                        context.peer(), " or ".join(roles))
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"a {role!r} certificate may not call this; it takes "
                                f"{' or '.join(roles)}")

    async def Generate(self, request: scheduler_pb2.GenerateRequest, context):
        """One stream for the request and its samples (n > 1), until each has finished."""
        await self._authorize(context, GATEWAY_ROLES)
        try:
            samples, index = self._start(request, tracing.current_span)
        except Refused as e:
            await context.abort(e.code, e.message)
        queue: asyncio.Queue[Output] = asyncio.Queue()
        for req in samples:
            self._streams[req.request_id] = queue
        self._wake_all()
        ids = [req.request_id for req in samples]
        running = set(ids)
        try:
            while running:
                out = await queue.get()
                self.telemetry.on_output(out)
                if out.finish_reason:
                    running.discard(out.request_id)
                yield _to_response(out, index[out.request_id])
        finally:  # finished, or the caller went away (cancellation lands here too)
            for i in ids:
                self._end(i)

    def _start(self, request: scheduler_pb2.GenerateRequest, span_of: Callable[[], object],
               ) -> tuple[list[Request], dict[str, int]]:
        """Adds the request's samples to the scheduler (those a resumption still runs);
        returns them and each id's sample index. Refused: nothing of it is left running.
        `span_of()`: the request's span, for telemetry (tracing on)."""
        gen = request_from_pb(request)
        ids = [gen.request_id or uuid.uuid4().hex, *gen.sample_ids]
        for i in ids:
            if i in self._streams:
                raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"request id {i} is in use")
        samples = [Request(request_id=i, prompt_token_ids=list(gen.prompt_token_ids),
                           sampling=gen.sampling.for_sample(j),
                           eos_token_ids=list(gen.eos_token_ids), priority=gen.priority,
                           cache_salt=gen.cache_salt)
                   for j, i in enumerate(ids)]
        index = {i: j for j, i in enumerate(ids)}
        try:
            samples = resume(samples, gen.resumed)
            if gen.resumed:  # each goes on from its own tokens, past the waiting limit
                for s in samples:
                    self.scheduler.add_request(s, resumed=True)
            elif samples:
                self.scheduler.add_request(samples[0], samples[1:])
        except (ValueError, QueueFull) as e:
            for s in samples:  # those added before the one refused
                self.scheduler.abort(s.request_id)
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, ValueError)
                          else grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        if self.telemetry.active:
            span = span_of() if tracing.enabled() else None
            for req in samples:
                self.telemetry.on_generate(req, index[req.request_id], span)
        return samples, index

    def _end(self, request_id: str) -> None:
        """A request's stream is done with it: finished, or closed early (then aborted)."""
        self._streams.pop(request_id, None)
        self.telemetry.on_end(request_id)
        if self.scheduler.abort(request_id) is not None:
            log.info("request %s aborted: its stream closed", request_id)
            self._wake_all()

    async def Session(self, request_iterator, context):
        """A gateway's requests, on one stream both ways (protos/scheduler.proto). The writer
        below sends what the requests' outputs and refusals gathered since its last message:
        the outputs of a step for every request in one message. Ends when the gateway closes
        its side, or takes no message for --session-write-timeout; what still runs is
        aborted."""
        await self._authorize(context, GATEWAY_ROLES)
        session = _Session()
        reader = asyncio.create_task(self._read_session(context, session))
        timeout = self.config.session_write_timeout_s
        try:
            while True:
                await session.ready.wait()
                session.ready.clear()
                for message in session.take():
                    if not await written(context, message, timeout):
                        log.error("gateway %s took no outputs in %.0fs; its session ends and "
                                  "its %d requests are aborted", context.peer(), timeout,
                                  len(session.requests))
                        return
                if session.closed:
                    break
        finally:
            reader.cancel()
            for r in list(session.requests.values()):
                r.close()

    async def _read_session(self, context, session: _Session) -> None:
        try:
            while True:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    break
                if msg.HasField("generate"):
                    self._session_generate(session, msg.generate)
                elif msg.HasField("abort"):
                    r = session.of_id.get(msg.abort)
                    if r is not None:
                        r.drop(msg.abort)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            session.closed = True
            session.ready.set()

    def _session_generate(self, session: _Session, request: scheduler_pb2.GenerateRequest
                          ) -> None:
        rid = request.request_id
        span = None
        try:
            if not rid:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              "a session's request needs a request_id")
            if rid in session.requests:
                raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid} is in use")
            span = tracing.start_span(tracing.REQUEST_SPAN,
                                      tracing.extract(request.trace_context), kind="server")
            samples, index = self._start(request, lambda: span)
        except Refused as e:
            if span is not None:
                span.set_attribute("rpc.grpc.status_code", e.code.value[0])
                tracing.end_span(span)
            session.refuse(rid, e.code, e.message)
            return
        r = _SessionRequest(self, session, rid, index, span)
        for req in samples:
            self._streams[req.request_id] = r
            session.of_id[req.request_id] = r
            r.running.add(req.request_id)
        session.requests[rid] = r
        if not r.running:  # a resumption whose samples had all finished
            r.close()
        self._wake_all()

    async def Abort(self, request: scheduler_pb2.AbortRequest, context):
        await self._authorize(context, GATEWAY_ROLES)
        out = self.scheduler.abort(request.request_id)
        if out is not None:
            self._dispatch([out])
            self._wake_all()
        return scheduler_pb2.AbortResponse(found=out is not None)

    async def Stats(self, request, context):
        await self._authorize(context, STATS_ROLES)
        s = self.scheduler
        resp = scheduler_pb2.StatsResponse(num_running=s.num_running, num_waiting=len(s.waiting),
                                           num_finished=s.num_finished,
                                           num_preemptions=s.num_preemptions)
        for w in s.workers.values():
            c = w.counters
            resp.workers.add(
                worker_id=w.worker_id, role=w.role, kv_endpoint=w.endpoint,
                num_blocks=w.kv.num_blocks, num_free_blocks=w.kv.num_free_blocks,
                num_running=len(w.kv.request_ids()),
                prompt_tokens_computed=c.prompt_tokens_computed, tokens_decoded=c.tokens_decoded,
                kv_blocks_sent=c.kv_blocks_sent, kv_blocks_received=c.kv_blocks_received,
                steps=c.steps, num_speculative_tokens=w.num_speculative_tokens,
                spec_decode_num_drafts=c.spec_drafts,
                spec_decode_num_draft_tokens=c.spec_draft_tokens,
                spec_decode_num_accepted_tokens=c.spec_accepted_tokens,
                spec_decode_num_accepted_tokens_per_pos=c.spec_accepted_per_pos,
                kv_frames_rejected=c.kv_frames_rejected,
                num_tier_blocks=w.kv.tier.num_slots if w.kv.tier else 0, tier_id=w.tier_id,
                num_tier_used_blocks=len(w.kv.tier) if w.kv.tier else 0,
                tier_hit_tokens=w.kv.num_tier_hit_tokens,
                tier_blocks_stored=c.tier_blocks_stored, tier_blocks_loaded=c.tier_blocks_loaded,
                tensor_parallel_size=w.layout.tensor_parallel_size,
                pipeline_parallel_size=w.layout.pipeline_parallel_size,
                kv_bytes_sent_per_rank=c.kv_bytes_sent_per_rank)
        return resp

    # ---- worker side ---------------------------------------------------------------------------

    async def Attach(self, request_iterator, context):
        await self._authorize(context, WORKER_ROLES)
        try:
            first = await asyncio.wait_for(context.read(), self.config.register_timeout_s)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no registration in time")
        if first is grpc.aio.EOF or not first.HasField("register"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must register")
        try:
            w = self.scheduler.add_worker(registration_from_pb(first.register))
        except RegistrationError as e:
            log.warning("refused worker %s: %s", first.register.worker_id, e)
            await context.write(worker_pb2.SchedulerMessage(
                ack=worker_pb2.RegisterAck(worker_id=first.register.worker_id, error=str(e))))
            return
        wid = w.worker_id
        await context.write(worker_pb2.SchedulerMessage(ack=worker_pb2.RegisterAck(worker_id=wid)))
        wake = self._wake[wid] = asyncio.Event()
        link = _WorkerLink(wid, context)
        reader = asyncio.create_task(self._read(link, wake))
        self._wake_all()
        try:
            await self.update_health()
            await self._drive(link, wake)
        finally:
            reader.cancel()
            del self._wake[wid]
            self.scheduler.remove_worker(wid)
            self._wake_all()
            await self.update_health()
        error = reader.exception() if reader.done() and not reader.cancelled() else None
        if error is not None:
            raise error  # a message it could not apply: the worker was dropped

    async def _read(self, link: _WorkerLink, wake: asyncio.Event) -> None:
        """Applies the worker's messages in the order it sent them: a step's result always
        before the TransfersDone of that step's sends."""
        wid = link.worker_id
        try:
            while True:
                msg = await link.context.read()
                if msg is grpc.aio.EOF:
                    break
                if msg.HasField("transfers"):
                    self.scheduler.transfers_done(wid, transfers_done_from_pb(msg.transfers))
                elif msg.HasField("leave"):
                    self.scheduler.drain_worker(wid)
                    await self.update_health()  # a path it made may be gone now
                elif msg.HasField("result") and link.steps \
                        and msg.result.step_id == link.steps[0][0]:
                    result = result_from_pb(msg.result)
                    try:
                        outputs = self.scheduler.update(wid, result)
                    except ProtocolError as e:  # nothing of it was applied
                        log.error("worker %s answered out of protocol (%s); dropping it", wid, e)
                        break
                    self._dispatch(outputs)
                    if not result.more:  # a plan of several decode steps ends at its last
                        link.steps.popleft()[1].set_result(True)
                else:
                    log.error("worker %s answered out of protocol; dropping it", wid)
                    break
                self._wake_all()
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            link.gone = True
            for _, done in link.steps:
                if not done.done():
                    done.set_result(False)
            wake.set()

    async def _drive(self, link: _WorkerLink, wake: asyncio.Event):
        """Plans the worker's steps: a regular plan when it is idle and has work, and, while a
        step runs, the next decode step ahead of its result (Scheduler.schedule_ahead)."""
        wid = link.worker_id
        while True:
            wake.clear()
            if link.gone:
                return
            if self.scheduler.drained(wid):
                log.info("worker %s drained: it leaves", wid)
                return
            if not link.steps:
                planned_at = time.time()
                plan = self.scheduler.schedule(wid) if self.scheduler.has_work(wid) else None
                if plan is None:
                    try:
                        await asyncio.wait_for(wake.wait(), IDLE_POLL_S)
                    except TimeoutError:
                        pass
                    continue
                if not await self._send(link, plan, planned_at):
                    return
            # again if the running step's result landed while a plan was being written
            while len(link.steps) == 1 and \
                    (ahead := self.scheduler.schedule_ahead(wid)) is not None:
                if not await self._send(link, ahead, time.time()):
                    return
            if not link.steps:
                continue  # answered while the plan was being written
            step_id, done = link.steps[0]
            try:
                if not await asyncio.wait_for(done, self.config.step_timeout_s):
                    return  # the worker is gone
            except TimeoutError:
                log.error("worker %s did not answer step %d in %.0fs; dropping it", wid,
                          step_id, self.config.step_timeout_s)
                return

    async def _send(self, link: _WorkerLink, plan: StepPlan, planned_at: float) -> bool:
        """Writes a plan; False when the worker took none within the step timeout (alive to
        keepalive's pings but reading nothing: it is dropped)."""
        self.telemetry.on_plan(link.worker_id, plan, planned_at)
        link.steps.append((plan.step_id, asyncio.get_running_loop().create_future()))
        message = worker_pb2.SchedulerMessage(plan=plan_to_pb(plan))
        if not await written(link.context, message, self.config.step_timeout_s):
            log.error("worker %s took no plan in %.0fs; dropping it", link.worker_id,
                      self.config.step_timeout_s)
            return False
        return True


class _WorkerLink:
    """One attached worker's stream, and the steps it runs (id, future of the result), oldest
    first."""

    def __init__(self, worker_id: str, context) -> None:
        self.worker_id = worker_id
        self.context = context
        self.steps: deque[tuple[int, asyncio.Future[bool]]] = deque()
        self.gone = False


class _Session:
    """One gateway's Session stream: its requests by id (and by each sample's id), and what
    waits to be written: outputs in messages of up to SESSION_MESSAGE_BYTES (an output larger
    than that goes alone, as on a Generate stream), refusals."""

    def __init__(self) -> None:
        self.requests: dict[str, _SessionRequest] = {}
        self.of_id: dict[str, _SessionRequest] = {}
        self.full: list[list[scheduler_pb2.GenerateResponse]] = []
        self.pending: list[scheduler_pb2.GenerateResponse] = []
        self.pending_bytes = 0
        self.refused: list[scheduler_pb2.Refusal] = []
        self.ready = asyncio.Event()
        self.closed = False

    def send(self, response: scheduler_pb2.GenerateResponse) -> None:
        size = response.ByteSize()
        if self.pending and self.pending_bytes + size > SESSION_MESSAGE_BYTES:
            self.full.append(self.pending)
            self.pending, self.pending_bytes = [], 0
        self.pending.append(response)
        self.pending_bytes += size
        self.ready.set()

    def refuse(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        self.refused.append(scheduler_pb2.Refusal(request_id=request_id, code=code.value[0],
                                                  message=message))
        self.ready.set()

    def take(self) -> list[scheduler_pb2.SessionResponse]:
        """What gathered since the last messages, as messages to write in this order."""
        batches = (self.full + [self.pending]) if self.pending else self.full
        messages = [scheduler_pb2.SessionResponse(outputs=b) for b in batches]
        if self.refused:
            messages.append(scheduler_pb2.SessionResponse(refused=self.refused))
        self.full, self.pending, self.pending_bytes, self.refused = [], [], 0, []
        return messages


class _SessionRequest:
    """A request on a Session: its outputs go to the session's next message, named by its
    request_id; it ends when every sample it runs has finished or was aborted by the gateway.
    put_nowait: the same call as a Generate stream's queue, for SchedulerService._dispatch."""

    def __init__(self, service: SchedulerService, session: _Session, request_id: str,
                 index: dict[str, int], span) -> None:
        self.service = service
        self.session = session
        self.request_id = request_id
        self.index = index
        self.span = span
        self.running: set[str] = set()

    def put_nowait(self, out: Output) -> None:
        response = _to_response(out, self.index[out.request_id])
        response.request_id = self.request_id
        self.session.send(response)
        self.service.telemetry.on_output(out)
        if out.finish_reason:
            self.drop(out.request_id)

    def drop(self, request_id: str) -> None:
        """One sample is done: finished, or aborted by the gateway (nothing more is sent for
        it)."""
        if request_id not in self.running:
            return
        self.running.discard(request_id)
        self.session.of_id.pop(request_id, None)
        self.service._end(request_id)
        if not self.running:
            self.close()

    def close(self) -> None:
        """Ends it, aborting the samples still running (the session ended)."""
        for i in list(self.running):
            self.drop(i)
        if self.session.requests.pop(self.request_id, None) is not None:
            tracing.end_span(self.span)


def _to_response(out: Output, sample: int) -> scheduler_pb2.GenerateResponse:
    return output_to_pb(GenerateOutput(
        token_ids=tuple(out.token_ids), logprobs=tuple(out.logprobs),
        prompt_logprobs=tuple(out.prompt_logprobs), finish_reason=out.finish_reason,
        num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
        stop_token_id=out.stop_token_id, error=out.error, sample=sample))


async def create_server(config: SchedulerConfig) -> tuple[grpc.aio.Server, int, SchedulerService]:
    server = grpc.aio.server(options=server_options(config.keepalive_time_s,
                                                    config.keepalive_timeout_s),
                             interceptors=tracing.aio_server_interceptors(TRACED_METHODS))
    service = SchedulerService(config, Health(server))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, server)
    worker_pb2_grpc.add_WorkerControlServicer_to_server(service, server)
    address = f"{config.host}:{config.port}"
    if config.tls is not None:
        port = server.add_secure_port(address, grpc_server_credentials(config.tls))
    else:
        warn_if_exposed(config.host, None, "the scheduler",
                        "submit and abort requests, read every stat, or attach as a worker")
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    if config.health_port:
        await service.health.also_serve(config.host, config.health_port)
    await service.update_health()  # NOT_SERVING: no worker yet
    await service.health.set(API_SERVICE, True)
    await server.start()
    return server, port, service
