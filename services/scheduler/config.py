"""Scheduler configuration; CLI flags map 1:1 to these fields."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0           # 0: the smallest of the workers' limits
    scheduling_policy: str = "fcfs"
    placement: str = "least-loaded"
    step_timeout_s: float = 120.0    # a worker that does not answer a step in time is dropped
    register_timeout_s: float = 30.0

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be >= 1")
        if self.max_model_len < 0:
            raise ValueError("--max-model-len must be >= 0")
        if self.step_timeout_s <= 0 or self.register_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
