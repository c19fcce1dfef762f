"""Scheduler configuration; CLI flags map 1:1 to these fields."""
from __future__ import annotations

from dataclasses import dataclass

from common.grpc_options import KEEPALIVE_TIME_S, KEEPALIVE_TIMEOUT_S
from common.tls import TLSFiles


@dataclass(frozen=True)
class SchedulerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0           # 0: the smallest of the workers' limits
    scheduling_policy: str = "fcfs"
    placement: str = "prefix-aware"
    mode: str = "disaggregated"        # or "colocated": decode workers only, each does both
    enable_prefix_caching: bool = True
    prefill_bypass_threshold: int = 256  # short prompts: their decode worker may prefill them
    saturated_prefill_bypass: bool = True  # ... and long ones while every prefill worker is busy
    shared_cores_prefill_bypass: bool = True  # ... or, one at a time beside its batch, while
                                              # a prefill worker sharing its cores is free
    decode_prefill_tokens: int = 256   # most prompt tokens a decode worker computes in a step
    decode_long_prefill_tokens: int = 32  # ... while it holds a long prompt, until timed
    decode_step_target_ms: float = 250.0  # ... then sized to steps of this length (0: fixed)
    decode_hold_margin: float = 1.0    # ... taken if done in 1/margin of a prefill worker's time
    price_holds: bool = True           # ... and if its batch loses less than the prompts gain
    tpot_slo_ms: float = 30.0          # ... counting what takes requests past this TPOT
                                       # (0: every second they step held)
    prefill_take_back: bool = False    # ... and taken back by a prefill worker done sooner
    max_num_partial_prefills: int = 2  # a short prompt's fast lane beside one long prompt
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0  # 0: half the step budget when partials > 1
    max_waiting_requests: int = 1024   # beyond it new requests get 429; 0: unbounded
    async_scheduling: bool = True      # plan a decode step while the one before it runs
    num_scheduler_steps: int = 1       # decode steps a decode-only plan runs (multi-step)
    step_timeout_s: float = 120.0    # a worker that does not answer a step in time is dropped
    session_write_timeout_s: float = 30.0  # a gateway that takes no outputs this long: its
                                           # session ends and its requests are aborted
    keepalive_time_s: float = KEEPALIVE_TIME_S  # a quiet link to a worker or gateway is pinged
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S  # ... and dropped when it does not answer
    register_timeout_s: float = 30.0
    tls: TLSFiles | None = None      # mutual TLS, each caller's role checked (common/tls.py)
    health_port: int = 0             # a health-only port in the clear (probes under TLS); 0: none

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be >= 1")
        if self.max_model_len < 0:
            raise ValueError("--max-model-len must be >= 0")
        if min(self.step_timeout_s, self.session_write_timeout_s, self.register_timeout_s,
               self.keepalive_time_s, self.keepalive_timeout_s) <= 0:
            raise ValueError("timeouts must be positive")
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"unknown --mode {self.mode!r}; known: disaggregated, colocated")
        if self.max_num_partial_prefills < 1 or self.max_long_partial_prefills < 1:
            raise ValueError("--max-num-partial-prefills and --max-long-partial-prefills "
                             "must be >= 1")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError("--max-long-partial-prefills cannot exceed "
                             "--max-num-partial-prefills")
        if self.decode_long_prefill_tokens < 1:
            raise ValueError("--decode-long-prefill-tokens must be >= 1")
        if self.decode_step_target_ms < 0:
            raise ValueError("--decode-step-target-ms must be >= 0")
        if self.tpot_slo_ms < 0:
            raise ValueError("--tpot-slo-ms must be >= 0")
        if self.decode_hold_margin < 1:
            raise ValueError("--decode-hold-margin must be >= 1")
        if self.num_scheduler_steps < 1:
            raise ValueError("--num-scheduler-steps must be >= 1")
        if self.decode_prefill_tokens < 1:
            raise ValueError("--decode-prefill-tokens must be >= 1")
        for name in ("prefill_bypass_threshold", "long_prefill_token_threshold",
                     "max_waiting_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
