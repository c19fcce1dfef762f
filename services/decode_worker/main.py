"""`pdserve decode-worker`: a worker of the decode pool."""
from __future__ import annotations

import argparse
import asyncio

from common.worker import config, service


def add_arguments(p: argparse.ArgumentParser) -> None:
    config.add_arguments(p)


def run(args) -> int:
    return asyncio.run(service.serve(config.config_from_args("decode", args)))
