"""`pdserve prefill-worker` and `pdserve decode-worker`: one entry point for both pools.

The two differ only in the role of their WorkerConfig, named by the subcommand. The worker itself
lives in common/worker, below the services: the scheduler's in-process tests and the benchmarks
build workers without this CLI.
"""
from __future__ import annotations

import argparse
import asyncio

from common.worker import config, service

ROLES = {"prefill-worker": "prefill", "decode-worker": "decode"}  # subcommand -> role


def add_arguments(p: argparse.ArgumentParser) -> None:
    config.add_arguments(p)


def run(args) -> int:
    role = ROLES[args.command]
    return asyncio.run(service.serve(config.config_from_args(role, args)))
