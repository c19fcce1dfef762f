"""`pdserve scheduler`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from common import metrics, tracing
from common.tls import add_tls_args, tls_from_args
from services.scheduler.config import SchedulerConfig
from services.scheduler.server import create_server

log = logging.getLogger("pdserve.scheduler")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SchedulerConfig()
    p.add_argument("--host", default=os.environ.get("PDSERVE_SCHEDULER_HOST", d.host),
                   help="address to listen on (env PDSERVE_SCHEDULER_HOST)")
    p.add_argument("--port", type=int,
                   default=int(os.environ.get("PDSERVE_SCHEDULER_PORT", d.port)),
                   help="gRPC port for gateways and workers; 0 picks a free one "
                        "(env PDSERVE_SCHEDULER_PORT)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="most requests holding KV blocks on one worker at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one worker step (longer prompts are chunked)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="longest prompt + output in tokens; 0 takes the workers' limit")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy,
                   help="order of admission from the waiting queue")
    p.add_argument("--placement", default=d.placement,
                   help="how a decode worker is chosen: prefix-aware | least-loaded")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], default=d.mode,
                   help="colocated: decode workers only, each prefills its own requests "
                        "(the baseline disaggregation is measured against)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching,
                   help="reuse the KV of full blocks already computed for the same prefix")
    p.add_argument("--prefill-bypass-threshold", type=int, default=d.prefill_bypass_threshold,
                   help="a prompt with at most this many uncached tokens is prefilled by its "
                        "decode worker when no prefill worker is free to start it now, or when "
                        "the decode worker caches more of it; 0: only by prefill workers")
    p.add_argument("--saturated-prefill-bypass", action=argparse.BooleanOptionalAction,
                   default=d.saturated_prefill_bypass,
                   help="when every prefill worker is busy, a decode worker with room prefills "
                        "a longer prompt too, one at a time, if at the prefill speeds measured "
                        "so far it would finish it sooner than a prefill worker (trades its "
                        "decodes' TPOT, within --decode-prefill-tokens a step, for the "
                        "prompt's TTFT)")
    p.add_argument("--shared-cores-prefill-bypass", action=argparse.BooleanOptionalAction,
                   default=d.shared_cores_prefill_bypass,
                   help="a decode worker with a batch prefills a longer prompt beside it, one "
                        "at a time, while a prefill worker sharing its CPU cores (cores lent, "
                        "`pdserve up`'s default) is free: that one lends it every core, and the "
                        "prompt's KV stays put; never one a prefill worker caches more of "
                        "(trades its decodes' TPOT, --decode-step-target-ms meanwhile, for the "
                        "prompt's TTFT)")
    p.add_argument("--decode-prefill-tokens", type=int, default=d.decode_prefill_tokens,
                   help="with prefill workers, the most prompt tokens a decode worker computes "
                        "in one step beside its batch: bounds what a prefill there adds to "
                        "the step time of every request it decodes")
    p.add_argument("--decode-long-prefill-tokens", type=int,
                   default=d.decode_long_prefill_tokens,
                   help="while it holds a prompt longer than --prefill-bypass-threshold "
                        "(taken under --saturated-prefill-bypass), the prompt tokens of its "
                        "steps until one of them is timed (then --decode-step-target-ms)")
    p.add_argument("--decode-step-target-ms", type=float, default=d.decode_step_target_ms,
                   help="while a decode worker holds such a long prompt, its steps carry the "
                        "prompt tokens (between 16 and --decode-prefill-tokens) that its "
                        "measured steps say fit in this many ms beside its batch: about the "
                        "TPOT its requests see meanwhile; 0: always "
                        "--decode-long-prefill-tokens")
    p.add_argument("--decode-hold-margin", type=float, default=d.decode_hold_margin,
                   help="under --saturated-prefill-bypass a decode worker takes a long prompt "
                        "only if, at the measured speeds, it would finish it in 1/margin of "
                        "the time the soonest prefill worker needs (its backlog and the "
                        "prompt): its decodes slow to --decode-step-target-ms meanwhile, so "
                        "it takes one only when that wins the prompt much time; 1: whenever "
                        "it would finish sooner")
    p.add_argument("--price-holds", action=argparse.BooleanOptionalAction,
                   default=d.price_holds,
                   help="either bypass holds a long prompt beside a decode worker's batch only "
                        "when the batch loses less time (its requests step at "
                        "--decode-step-target-ms until the prompt is done) than the prompt "
                        "gains against a prefill worker, the gain weighed up by the prefill "
                        "workers' measured load from long prompts (always at a load of 1 or "
                        "more); --no-price-holds: whenever the bypass's own conditions hold")
    p.add_argument("--tpot-slo-ms", type=float, default=d.tpot_slo_ms,
                   help="the TPOT a request should keep (ms per output token after its first, "
                        "on average): a hold's price (--price-holds) counts only the time it "
                        "takes the batch's requests past that budget, from where each stands; "
                        "0: every second they step at --decode-step-target-ms counts")
    p.add_argument("--prefill-take-back", action=argparse.BooleanOptionalAction,
                   default=d.prefill_take_back,
                   help="a prefill worker with no prompt left to compute takes over a long "
                        "prompt a decode worker holds when, at the measured paces, it would "
                        "finish it sooner than the decode worker from where it is (the decode "
                        "worker keeps it if done in 1/--decode-hold-margin of that time); the "
                        "decode worker first sends it the prompt's KV computed so far")
    p.add_argument("--max-num-partial-prefills", type=int, default=d.max_num_partial_prefills,
                   help="prompts a worker may have started and not finished prefilling at once")
    p.add_argument("--max-long-partial-prefills", type=int, default=d.max_long_partial_prefills,
                   help="of those, how many may be longer than --long-prefill-token-threshold")
    p.add_argument("--long-prefill-token-threshold", type=int,
                   default=d.long_prefill_token_threshold,
                   help="a prompt longer than this is long; also the chunk cap per prompt when "
                        "partial prefills > 1; 0: half of --max-num-batched-tokens")
    p.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                   help="beyond this many queued requests new ones get 429; 0: unbounded")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=d.async_scheduling,
                   help="plan a worker's next decode step while its current one runs, so that "
                        "it never waits for a round trip to the scheduler between steps")
    p.add_argument("--num-scheduler-steps", type=int, default=d.num_scheduler_steps,
                   help="a plan that only decodes runs this many decode steps on the worker "
                        "(blocks held for their tokens; stops checked there; each step's tokens "
                        "streamed as it ends); 1: one step a plan")
    p.add_argument("--step-timeout", type=float, default=d.step_timeout_s,
                   help="seconds a worker may take for one step before it is dropped")
    p.add_argument("--session-write-timeout", type=float, default=d.session_write_timeout_s,
                   help="seconds a gateway may leave its Session stream's outputs unread (alive "
                        "to keepalive's pings but reading nothing) before the session ends and "
                        "its requests are aborted")
    p.add_argument("--keepalive-time", type=float, default=d.keepalive_time_s,
                   help="seconds after which a quiet link to a worker or gateway is pinged")
    p.add_argument("--keepalive-timeout", type=float, default=d.keepalive_timeout_s,
                   help="seconds a ping may go unanswered before its link is dropped (a frozen "
                        "worker's requests are then re-queued)")
    p.add_argument("--health-port", type=int,
                   default=int(os.environ.get("PDSERVE_SCHEDULER_HEALTH_PORT", d.health_port)),
                   help="also serve grpc.health.v1 alone on this port, in the clear: for probes "
                        "that cannot present a certificate (Kubernetes' grpc probes) when the "
                        "API port takes mutual TLS; 0: none (env PDSERVE_SCHEDULER_HEALTH_PORT)")
    add_tls_args(p, "scheduler")
    metrics.add_arguments(p)
    tracing.add_arguments(p)


def config_from_args(args) -> SchedulerConfig:
    return SchedulerConfig(host=args.host, port=args.port, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           max_model_len=args.max_model_len,
                           scheduling_policy=args.scheduling_policy, placement=args.placement,
                           step_timeout_s=args.step_timeout,
                           session_write_timeout_s=args.session_write_timeout, mode=args.mode,
                           keepalive_time_s=args.keepalive_time,
                           keepalive_timeout_s=args.keepalive_timeout,
                           enable_prefix_caching=args.enable_prefix_caching,
                           prefill_bypass_threshold=args.prefill_bypass_threshold,
                           saturated_prefill_bypass=args.saturated_prefill_bypass,
                           shared_cores_prefill_bypass=args.shared_cores_prefill_bypass,
                           decode_prefill_tokens=args.decode_prefill_tokens,
                           decode_long_prefill_tokens=args.decode_long_prefill_tokens,
                           decode_step_target_ms=args.decode_step_target_ms,
                           decode_hold_margin=args.decode_hold_margin,
                           price_holds=args.price_holds,
                           tpot_slo_ms=args.tpot_slo_ms,
                           prefill_take_back=args.prefill_take_back,
                           max_num_partial_prefills=args.max_num_partial_prefills,
                           max_long_partial_prefills=args.max_long_partial_prefills,
                           long_prefill_token_threshold=args.long_prefill_token_threshold,
                           max_waiting_requests=args.max_waiting_requests,
                           async_scheduling=args.async_scheduling,
                           num_scheduler_steps=args.num_scheduler_steps,
                           tls=tls_from_args(args, "scheduler"), health_port=args.health_port)


async def serve(config: SchedulerConfig, metrics_host: str = "127.0.0.1",
                metrics_port: int = 0) -> None:
    server, port, service = await create_server(config)
    log.info("scheduler listening on %s:%d", config.host, port)
    print(f"pdserve scheduler listening on {config.host}:{port}"
          f"{' (mutual TLS)' if config.tls else ''}", flush=True)
    if metrics_port:
        await metrics.start_metrics_server(service.telemetry.registry, metrics_host,
                                           metrics_port)
        service.telemetry.metrics_on = True
        print(f"pdserve scheduler metrics on http://{metrics_host}:{metrics_port}/metrics",
              flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await service.health.stop()  # probes see NOT_SERVING while the streams drain
    await server.stop(grace=2.0)


def run(args) -> int:
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"pdserve scheduler: {e}", file=sys.stderr)
        return 2
    tracing.setup_tracing("pdserve-scheduler", args.otlp_traces_endpoint)
    asyncio.run(serve(config, args.metrics_host, args.metrics_port))
    return 0
