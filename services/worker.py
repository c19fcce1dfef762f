"""`pdserve prefill-worker` and `pdserve decode-worker`: one entry point for both pools.

The two differ only in the role of their WorkerConfig, named by the subcommand. The worker itself
lives in common/worker, below the services: the scheduler's in-process tests and the benchmarks
build workers without this CLI.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import traceback

from common.worker import config

ROLES = {"prefill-worker": "prefill", "decode-worker": "decode"}  # subcommand -> role


def add_arguments(p: argparse.ArgumentParser) -> None:
    config.add_arguments(p)


def run(args) -> int:
    # torch and the model code (~5 s of imports) load here, not with the argument parser:
    # `pdserve decode-worker --help` needs none of them
    from common.worker import group, service
    try:
        cfg = config.config_from_args(ROLES[args.command], args)
    except ValueError as e:
        print(f"pdserve {args.command}: {e}", file=sys.stderr)
        return 2
    if cfg.group_size == 1:
        return asyncio.run(service.serve(cfg))
    status = 1
    try:
        status = asyncio.run(service.serve(cfg))
    except Exception:  # noqa: BLE001 - surfaced as the interpreter would (traceback, status 1),
        # but the exit below skips its teardown, which would abort beside gloo's threads
        traceback.print_exc()
    finally:
        group.leave(status)  # no interpreter teardown beside gloo's threads
