"""`pdserve gateway`: flags (named like vLLM's), config, and the uvicorn server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import socket
import sys
from typing import TYPE_CHECKING

import uvicorn

from common import torch_free, tracing
from common.heap import freeze_startup_heap
from common.tls import add_tls_args, is_loopback, tls_from_args
from services.gateway.tools import PARSERS

if TYPE_CHECKING:
    from services.gateway.config import GatewayConfig

# The serving modules (transformers: ~3 s) are imported by config_from_args and serve, before
# the gateway listens, not here: `pdserve gateway --help` and the argument parser need none of
# them. torch is kept out of the process (torch_free.py).

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env_model = os.environ.get("PDSERVE_MODEL")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address.")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port.")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="Gateway processes serving the port (tokenizing, detokenizing and streaming "
        "spread over them); /metrics sums them.",
    )
    parser.add_argument(
        "--scheduler",
        default=os.environ.get("PDSERVE_SCHEDULER", "127.0.0.1:50051"),
        help="Scheduler gRPC address host:port (default: $PDSERVE_SCHEDULER or 127.0.0.1:50051).",
    )
    parser.add_argument(
        "--model",
        default=env_model,
        required=env_model is None,
        help="HuggingFace model directory, for the tokenizer, chat template and limits "
        "(default: $PDSERVE_MODEL).",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Model name(s) the API accepts; the first is reported (default: --model as given).",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="Context length: prompt plus completion (default: config.json "
        "max_position_embeddings).",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY"),
        help="Require `Authorization: Bearer <key>` on the API (default: $PDSERVE_API_KEY).",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="Deadline in seconds of every scheduler call; past it a request gets 504.",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        help="Seconds to wait for the scheduler connection at startup.",
    )
    parser.add_argument(
        "--no-worker-wait",
        type=float,
        default=5.0,
        help="Seconds a request waits while the scheduler reports no worker that can serve it "
        "(or cannot be reached); then it gets 503 with Retry-After.",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="On SIGTERM the gateway takes no new connection and lets open streams finish for "
        "up to this many seconds.",
    )
    parser.add_argument(
        "--scheduler-recovery-timeout",
        type=float,
        default=30.0,
        help="Seconds the streams of a lost scheduler wait for one that serves again; then "
        "each resubmits what it had not finished, with the tokens it had streamed, and goes on "
        "(0: they fail at once).",
    )
    parser.add_argument(
        "--max-request-body-mib",
        type=float,
        default=16.0,
        help="Largest request body in MiB; a larger one gets 413 before it is read.",
    )
    parser.add_argument(
        "--request-body-timeout",
        type=float,
        default=30.0,
        help="Seconds a client has to send its whole request body; then it gets 408.",
    )
    parser.add_argument(
        "--stream-write-timeout",
        type=float,
        default=30.0,
        help="Seconds a client may take nothing of its response; then the response is cut off "
        "and, streamed, its requests are aborted (a stalled reader never holds KV blocks for "
        "long).",
    )
    parser.add_argument(
        "--max-concurrent-requests-per-key",
        type=int,
        default=0,
        help="Generation requests one API key (its bearer credential; none: one shared budget) "
        "may have in flight in a gateway process; one more gets 429 with Retry-After (0: no "
        "limit).",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="Log level of the HTTP server.",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="Sampling defaults for what a request leaves out: auto (the model's "
        "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, and "
        "max_new_tokens as max_tokens), vllm (none: the API's own defaults), or a directory "
        "holding a generation_config.json.",
    )
    parser.add_argument(
        "--structured-outputs-config",
        default="",
        help='Structured outputs, as vLLM\'s JSON object: {"backend": "auto" or "xgrammar", '
        '"disable_any_whitespace": true: JSON without free whitespace for every request}.',
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (the default with tools): the model decides, and '
        "--tool-call-parser finds its calls in its text.",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default=None,
        help="How tool calls are written: hermes (<tool_call>{...}</tool_call>, Qwen, Hermes) "
        "or llama3_json (Llama 3's JSON calls).",
    )
    parser.add_argument("--ssl-keyfile", default=None,
                        help="HTTPS on the API: the server's private key (PEM)")
    parser.add_argument("--ssl-certfile", default=None,
                        help="HTTPS on the API: the server's certificate (PEM)")
    parser.add_argument("--ssl-ca-certs", default=None,
                        help="CA certificates that client certificates are checked against")
    parser.add_argument("--ssl-cert-reqs", type=int, default=0,
                        help="client certificates: 0 none, 1 optional, 2 required "
                             "(with --ssl-ca-certs)")
    add_tls_args(parser, "gateway")
    tracing.add_arguments(parser)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    from services.gateway.config import GatewayConfig
    from services.gateway.structured_outputs import StructuredOutputsConfig
    return GatewayConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        scheduler=args.scheduler,
        served_model_name=tuple(args.served_model_name or ()),
        max_model_len=args.max_model_len,
        api_key=args.api_key,
        generation_config=args.generation_config,
        request_timeout_s=args.request_timeout,
        connect_timeout_s=args.connect_timeout,
        no_worker_wait_s=args.no_worker_wait,
        scheduler_recovery_s=args.scheduler_recovery_timeout,
        drain_timeout_s=args.drain_timeout,
        structured_outputs=StructuredOutputsConfig.parse(args.structured_outputs_config),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        max_request_body_bytes=int(args.max_request_body_mib * (1 << 20)),
        request_body_timeout_s=args.request_body_timeout,
        stream_write_timeout_s=args.stream_write_timeout,
        max_concurrent_requests_per_key=args.max_concurrent_requests_per_key,
        tls=tls_from_args(args, "gateway"),
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; 0 on a clean shutdown, 2 on a bad config, 1 otherwise."""
    torch_free.keep_out(args.model)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    try:
        config = config_from_args(args)
    except ValueError as err:
        print(f"pdserve gateway: {err}", file=sys.stderr)
        return 2
    if config.sampling_defaults.given():
        logger.info(
            "sampling defaults from --generation-config %s: %s (`--generation-config vllm` "
            "drops them)", config.generation_config, config.sampling_defaults.given()
        )
    if args.workers < 1:
        print("pdserve gateway: --workers must be >= 1", file=sys.stderr)
        return 2
    if args.workers > 1:
        from services.gateway.processes import run_processes
        return run_processes(config, args.workers, args.uvicorn_log_level,
                             args.otlp_traces_endpoint)
    tracing.setup_tracing("pdserve-gateway", args.otlp_traces_endpoint)
    try:
        return asyncio.run(serve(config, log_level=args.uvicorn_log_level))
    except KeyboardInterrupt:
        return 130


async def serve(
    config: GatewayConfig, log_level: str = "info", sock: socket.socket | None = None
) -> int:
    """Run the gateway in the current event loop (on `sock` if given, else host:port)."""
    from services.gateway.app import create_app
    from services.gateway.scheduler_client import SchedulerClient
    client = SchedulerClient.connect(
        config.scheduler, config.request_timeout_s, config.connect_timeout_s,
        config.scheduler_recovery_s, config.tls,
    )
    if not config.ssl_certfile and not is_loopback(config.host):
        logger.warning(
            "the gateway serves plain HTTP on %s: API keys, prompts and completions cross the "
            "network in the clear (--ssl-certfile/--ssl-keyfile serve HTTPS)", config.host)
    try:
        if not await client.ready():
            logger.warning(
                "scheduler %s not reachable yet; /ready answers 503 until it is", config.scheduler
            )
        app = create_app(config, client)  # the tokenizer and the templates loaded
        freeze_startup_heap()
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                log_level=log_level,
                timeout_graceful_shutdown=math.ceil(config.drain_timeout_s),
                ssl_keyfile=config.ssl_keyfile,
                ssl_certfile=config.ssl_certfile,
                ssl_ca_certs=config.ssl_ca_certs,
                ssl_cert_reqs=config.ssl_cert_reqs,
            )
        )
        try:
            await server.serve(sockets=[sock] if sock is not None else None)
        except SystemExit as exc:  # uvicorn exits this way when it cannot bind
            return exc.code if isinstance(exc.code, int) else 1
        return 0 if server.started else 1
    finally:
        await client.close()
