"""Worker configuration; CLI flags map 1:1 to these fields."""
from __future__ import annotations

import argparse
import os
import socket
import uuid
from dataclasses import dataclass

from common import metrics, tracing
from common.kv_transfer import KNOWN_TRANSPORTS
from common.models import dtype as dtypes
from common.tls import TLSFiles, add_tls_args, tls_from_args
from common.worker.speculative import SpeculativeConfig


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    model: str
    scheduler: str = "127.0.0.1:50051"
    worker_id: str = ""
    dtype: str = "auto"              # weights and KV cache; auto: resolved at construction
    block_size: int = 16
    num_kv_blocks: int = 0           # 0: from kv_cache_memory_mib
    kv_cache_memory_mib: int = 0     # 0: 1024 on CPU, from gpu_memory_utilization on a GPU
    gpu_memory_utilization: float = 0.9
    kv_offloading_size_gib: float = 0.0  # a second KV tier in host memory; 0: none
    kv_offloading_blocks: int = 0    # its size in blocks instead (tests); 0: from the GiB
    kv_offloading_backend: str = "native"  # native: the worker's own; host: its host's, shared
    max_num_batched_tokens: int = 2048  # the largest step, profiled to size a GPU's KV cache
    max_model_len: int = 0           # 0: the model's max_position_embeddings
    cpu_threads: int = 0             # 0: torch's default (or one per core of cpu_cores)
    cpu_cores: tuple[int, ...] = ()  # pin the worker to these cores; (): no pinning
    cpu_nice: int = 0                # lower CPU priority (0-19): yields shared cores to others
    kv_transports: tuple[str, ...] = ("shm", "tcp")
    kv_host: str = "127.0.0.1"       # where the tcp KV listener binds
    kv_port: int = 0
    kv_advertise_host: str = ""      # the address peers dial; default kv_host
    kv_advertise_port: int = 0       # the port peers dial; default the bound one
    kv_secret: str = ""              # shared secret authenticating tcp KV frames
    kv_transfer_timeout_s: float = 30.0
    host_id: str = ""                # workers with equal host ids share memory (shm)
    attention_backend: str = "auto"
    device: str = "cpu"              # cpu | cuda | cuda:N | auto (cuda when there is one)
    enforce_eager: bool = False      # no CUDA graphs: every step runs the eager forward
    prepack_weights: bool = True     # on a CPU, linear weights packed once for oneDNN's GEMM
    use_tqdm_on_load: bool = True    # a progress bar over the weights (on a terminal only)
    max_cudagraph_capture_size: int = 256  # the largest decode batch captured as a graph
    seed: int = 0
    connect_timeout_s: float = 30.0
    write_timeout_s: float = 30.0    # a message the scheduler takes none of this long: the
                                     # stream is dropped and the worker attaches again
    metrics_port: int = 0            # 0: no /metrics
    metrics_host: str = "127.0.0.1"
    health_port: int = 0             # 0: no grpc.health.v1 server
    health_host: str = "127.0.0.1"
    otlp_traces_endpoint: str = ""   # "": the OTEL_EXPORTER_OTLP_* env vars, else no tracing
    detailed_traces: bool = False    # a span per decode step too
    reconnect_s: float = 1.0
    drain_timeout_s: float = 30.0    # SIGTERM: how long its requests may run on before it leaves
    speculative_config: str = ""     # vLLM's JSON (speculative.py); "": no speculation
    tls: TLSFiles | None = None      # mutual TLS to the scheduler and between workers
    tensor_parallel_size: int = 1    # > 1 here or below: a group of rank processes (group.py)
    pipeline_parallel_size: int = 1
    group_start_timeout_s: float = 600.0  # a group's ranks loading their shares of the model

    def __post_init__(self):
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"unknown role {self.role!r}; known: prefill, decode")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("--block-size must be a power of two")
        if self.num_kv_blocks < 0 or self.kv_cache_memory_mib < 0:
            raise ValueError("--num-kv-blocks and --kv-cache-memory-mib must be >= 0")
        if self.kv_offloading_size_gib < 0 or self.kv_offloading_blocks < 0:
            raise ValueError("--kv-offloading-size and --kv-offloading-blocks must be >= 0")
        if self.kv_offloading_backend not in ("native", "host"):
            raise ValueError("--kv-offloading-backend is native or host")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.max_cudagraph_capture_size < 1:
            raise ValueError("--max-cudagraph-capture-size must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be >= 1")
        if self.drain_timeout_s < 0:
            raise ValueError("--drain-timeout must be >= 0")
        if self.write_timeout_s <= 0:
            raise ValueError("--write-timeout must be > 0")
        if not 0 <= self.health_port <= 65535:
            raise ValueError("--health-port must be in 0..65535")
        if not 0 <= self.cpu_nice <= 19:
            raise ValueError("--cpu-nice must be in 0..19")
        self.speculative()  # raises for a config that does not parse
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu, cuda, cuda:N or auto, not {self.device!r}")
        self._set_dtype()
        if self.resolved_device() != "cpu" and self.kv_transports == ("shm", "tcp"):
            # the default on a GPU: device to device between workers of one host, else tcp
            object.__setattr__(self, "kv_transports", ("cuda_ipc", "tcp"))
        if self.resolved_device() != "cpu" and "shm" in self.kv_transports:
            raise ValueError("the shm KV transport needs the KV cache in host memory; on a GPU "
                             "use --kv-transports cuda_ipc, tcp or nccl")
        if self.resolved_device() == "cpu" and "cuda_ipc" in self.kv_transports:
            raise ValueError("the cuda_ipc KV transport needs the KV cache on a GPU "
                             "(--device cuda); in host memory use shm")
        unknown = set(self.kv_transports) - set(KNOWN_TRANSPORTS)
        if unknown or not self.kv_transports:
            raise ValueError(f"unknown KV transports {sorted(unknown)}; known: {KNOWN_TRANSPORTS}")
        self._check_group()
        if not self.worker_id:
            object.__setattr__(self, "worker_id",
                               f"{self.role}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}")

    def _check_group(self) -> None:
        """Refuses what a worker group does not do yet; its default transport is shm."""
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("--tensor-parallel-size and --pipeline-parallel-size must be >= 1")
        if self.group_size == 1:
            return
        if self.resolved_device() != "cpu":
            raise ValueError("worker groups (--tensor-parallel-size, --pipeline-parallel-size "
                             "> 1) run on CPU workers so far (gloo); GPU groups over NCCL are "
                             "not built yet")
        if not set(self.kv_transports) <= {"shm", "tcp"}:
            raise ValueError("a worker group exchanges KV over shm and tcp only so far (each "
                             "rank sends its layers and heads straight to the caches that hold "
                             "them); nccl between groups is not built yet")
        spec = self.speculative()
        if spec is not None and spec.method == "draft_model":
            raise ValueError("a draft model does not run in a worker group yet; ngram "
                             "speculation does")
        if spec is not None and self.pipeline_parallel_size > 1:
            raise ValueError("a pipeline-parallel worker group does not speculate yet")
        if self.kv_offloading_backend == "host" and (self.kv_offloading_size_gib
                                                     or self.kv_offloading_blocks):
            raise ValueError("--kv-offloading-backend host is one tier per host and model; a "
                             "worker group's ranks each need their own (use native)")

    @property
    def group_size(self) -> int:
        """Rank processes of this worker: T x P."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _set_dtype(self) -> None:
        """"auto" (and vLLM's aliases) become the dtype the model is served in, logged once."""
        if dtypes.canonical(self.dtype) == "auto":
            choice = dtypes.resolve_dtype("auto", self.model, self.resolved_device())
            dtypes.log_choice(choice)
            object.__setattr__(self, "dtype", choice.dtype)
        else:
            object.__setattr__(self, "dtype", dtypes.canonical(self.dtype))

    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if _cuda_available() else "cpu"
        return self.device


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def parse_cores(text: str) -> tuple[int, ...]:
    """"0-3,8" -> (0, 1, 2, 3, 8)."""
    cores: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        try:
            cores.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a core list: {text!r}") from None
    return tuple(cores)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = WorkerConfig(role="decode", model="", dtype="float32")  # for the defaults: no probing
    env = os.environ.get
    p.add_argument("--model", default=env("PDSERVE_MODEL"), required=env("PDSERVE_MODEL") is None,
                   help="HuggingFace checkpoint directory (env PDSERVE_MODEL)")
    p.add_argument("--scheduler", default=env("PDSERVE_SCHEDULER", d.scheduler),
                   help="scheduler address host:port (env PDSERVE_SCHEDULER)")
    p.add_argument("--worker-id", default=env("PDSERVE_WORKER_ID", ""),
                   help="unique id; default role-host-random")
    p.add_argument("--dtype", choices=dtypes.CHOICES, default="auto",
                   help="weights and KV cache dtype; auto: the checkpoint's torch_dtype on a GPU, "
                        "on a CPU bfloat16 where it computes bf16 natively (avx512_bf16, "
                        "amx_bf16), else float32")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks,
                   help="KV cache blocks; 0 sizes the cache from the memory flags")
    p.add_argument("--kv-cache-memory-mib", type=int, default=d.kv_cache_memory_mib,
                   help="memory for the KV cache when --num-kv-blocks is 0; 0: 1 GiB on CPU, "
                        "from --gpu-memory-utilization on a GPU")
    p.add_argument("--kv-offloading-size", type=float, default=d.kv_offloading_size_gib,
                   metavar="GIB",
                   help="a second KV tier of this many GiB in host memory behind the cache: "
                        "cached blocks the cache evicts are kept there and prefix hits in it "
                        "are copied back instead of recomputed; 0: none")
    p.add_argument("--kv-offloading-backend", choices=["native", "host"],
                   default=d.kv_offloading_backend,
                   help="where the second tier lives: native, the worker's own host memory; "
                        "host, one /dev/shm segment every CPU worker of the host serving the "
                        "same model maps (a prefix one computed, another loads; the first "
                        "worker sizes it)")
    p.add_argument("--kv-offloading-blocks", type=int, default=d.kv_offloading_blocks,
                   help="the second tier's size in blocks instead of --kv-offloading-size")
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=float(env("PDSERVE_GPU_MEMORY_UTILIZATION", d.gpu_memory_utilization)),
                   help="share of the GPU's memory this worker may use for weights, activations "
                        "and KV cache; workers sharing one GPU split it, e.g. 0.45 each "
                        "(env PDSERVE_GPU_MEMORY_UTILIZATION)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="the scheduler's step budget: a step this large is profiled before "
                        "the GPU's KV cache is sized")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="longest sequence; 0 takes the model's max_position_embeddings")
    p.add_argument("--cpu-cores", type=parse_cores, default=(),
                   help="pin this worker to these cores, e.g. 0-3,8 (workers sharing a host keep "
                        "off each other's cores); default: no pinning")
    p.add_argument("--cpu-threads", type=int, default=int(env("PDSERVE_CPU_THREADS", 0)),
                   help="torch threads for this worker; 0 keeps torch's default (a scheduler "
                        "whose workers share cores sets them per step)")
    p.add_argument("--cpu-nice", type=int, default=int(env("PDSERVE_CPU_NICE", 0)),
                   help="lower this worker's CPU priority by this much (0-19), so that a worker "
                        "sharing its cores at priority 0 (a decode worker) always gets them first "
                        "(env PDSERVE_CPU_NICE)")
    p.add_argument("--kv-transports", nargs="+", default=list(d.kv_transports),
                   help=f"KV transports offered, preferred first; known: {KNOWN_TRANSPORTS}")
    p.add_argument("--kv-host", default=env("PDSERVE_KV_HOST", d.kv_host),
                   help="address the tcp KV listener binds (env PDSERVE_KV_HOST)")
    p.add_argument("--kv-port", type=int, default=int(env("PDSERVE_KV_PORT", d.kv_port)),
                   help="tcp KV port; 0 picks a free one (env PDSERVE_KV_PORT)")
    p.add_argument("--kv-advertise-host", default=env("PDSERVE_KV_ADVERTISE_HOST", ""),
                   help="address peers dial for KV; default --kv-host "
                        "(env PDSERVE_KV_ADVERTISE_HOST)")
    p.add_argument("--kv-advertise-port", type=int,
                   default=int(env("PDSERVE_KV_ADVERTISE_PORT", 0)),
                   help="port peers dial for KV (behind NAT or a proxy); default the bound one")
    p.add_argument("--kv-secret", default=env("PDSERVE_KV_SECRET", ""),
                   help="shared secret authenticating KV frames, header and payload (HMAC-SHA256; "
                        "without one an xxh3 digest still guards every payload; env "
                        "PDSERVE_KV_SECRET)")
    p.add_argument("--kv-transfer-timeout", type=float, default=d.kv_transfer_timeout_s,
                   help="seconds one KV transfer may take before it fails")
    p.add_argument("--host-id", default=env("PDSERVE_HOST_ID", ""),
                   help="workers with the same host id use shared memory between them; "
                        "default hostname + machine id (env PDSERVE_HOST_ID)")
    p.add_argument("--attention-backend", default=d.attention_backend,
                   help="auto (triton on a GPU, cpu kernels on CPU) | cpu | torch | triton")
    p.add_argument("--device", default=env("PDSERVE_DEVICE", d.device),
                   help="cpu | cuda | cuda:N | auto: where the model and its KV cache live "
                        "(env PDSERVE_DEVICE)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, run every step eagerly instead of replaying decode steps from "
                        "CUDA graphs captured at start-up")
    p.add_argument("--no-prepack-weights", dest="prepack_weights", action="store_false",
                   help="on a CPU, multiply through torch's nn.Linear (the weight repacked on "
                        "every call) instead of weights packed once for oneDNN at load")
    p.add_argument("--use-tqdm-on-load", action=argparse.BooleanOptionalAction,
                   default=env("PDSERVE_USE_TQDM_ON_LOAD", "1").lower() not in ("0", "false",
                                                                              "no", "off"),
                   help="a progress bar while the weights load, shown only where stderr is a "
                        "terminal (env PDSERVE_USE_TQDM_ON_LOAD=0: none)")
    p.add_argument("--max-cudagraph-capture-size", type=int,
                   default=d.max_cudagraph_capture_size,
                   help="the largest decode batch captured as a CUDA graph; larger ones run "
                        "eagerly")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of unseeded sampling")
    metrics.add_arguments(p)
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                   help="on SIGTERM the worker takes no new request and leaves once its requests "
                        "finished, or after this many seconds (the rest are recomputed "
                        "elsewhere); a second signal: at once")
    p.add_argument("--write-timeout", type=float, default=d.write_timeout_s,
                   help="seconds a message to the scheduler (a step's result, the "
                        "registration) may wait to go out: a scheduler alive to keepalive's "
                        "pings but reading nothing; then the worker drops the stream and "
                        "attaches again")
    p.add_argument("--health-port", type=int, default=int(env("PDSERVE_HEALTH_PORT", 0)),
                   help="serve the gRPC health protocol (grpc.health.v1) on this port once the "
                        "model is loaded: SERVING while attached to the scheduler; 0: off "
                        "(env PDSERVE_HEALTH_PORT)")
    p.add_argument("--health-host", default=env("PDSERVE_HEALTH_HOST", d.health_host),
                   help="address the health port binds (env PDSERVE_HEALTH_HOST)")
    p.add_argument("--speculative-config", default=env("PDSERVE_SPECULATIVE_CONFIG", ""),
                   help='speculative decoding on this worker\'s decode steps, as vLLM\'s JSON: '
                        '\'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' '
                        "(env PDSERVE_SPECULATIVE_CONFIG); default: none")
    p.add_argument("--tensor-parallel-size", "-tp", type=int,
                   default=int(env("PDSERVE_TENSOR_PARALLEL_SIZE", 1)),
                   help="split the model over this many rank processes (one group serving as "
                        "one worker, its cores split between them; CPU, gloo); env "
                        "PDSERVE_TENSOR_PARALLEL_SIZE")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int,
                   default=int(env("PDSERVE_PIPELINE_PARALLEL_SIZE", 1)),
                   help="split the model's layers over this many stages, each of "
                        "--tensor-parallel-size ranks (one group of T x P processes serving as "
                        "one worker; CPU, gloo); env PDSERVE_PIPELINE_PARALLEL_SIZE")
    add_tls_args(p, "worker")
    tracing.add_arguments(p)
    p.add_argument("--detailed-traces", action="store_true",
                   help="with tracing on, a span per decode step of every request (costly)")


def config_from_args(role: str, args) -> WorkerConfig:
    return WorkerConfig(role=role, model=args.model, scheduler=args.scheduler,
                        worker_id=args.worker_id, dtype=args.dtype, block_size=args.block_size,
                        num_kv_blocks=args.num_kv_blocks,
                        kv_cache_memory_mib=args.kv_cache_memory_mib,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        kv_offloading_size_gib=args.kv_offloading_size,
                        kv_offloading_blocks=args.kv_offloading_blocks,
                        kv_offloading_backend=args.kv_offloading_backend,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, cpu_threads=args.cpu_threads,
                        cpu_cores=args.cpu_cores, cpu_nice=args.cpu_nice,
                        kv_transports=tuple(args.kv_transports), kv_host=args.kv_host,
                        kv_port=args.kv_port, kv_advertise_host=args.kv_advertise_host,
                        kv_advertise_port=args.kv_advertise_port,
                        kv_secret=args.kv_secret, kv_transfer_timeout_s=args.kv_transfer_timeout,
                        host_id=args.host_id,
                        attention_backend=args.attention_backend, seed=args.seed,
                        device=args.device, enforce_eager=args.enforce_eager,
                        prepack_weights=args.prepack_weights,
                        use_tqdm_on_load=args.use_tqdm_on_load,
                        max_cudagraph_capture_size=args.max_cudagraph_capture_size,
                        metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                        health_port=args.health_port, health_host=args.health_host,
                        drain_timeout_s=args.drain_timeout, write_timeout_s=args.write_timeout,
                        speculative_config=args.speculative_config,
                        otlp_traces_endpoint=args.otlp_traces_endpoint or "",
                        detailed_traces=args.detailed_traces,
                        tls=tls_from_args(args, "worker"),
                        tensor_parallel_size=args.tensor_parallel_size,
                        pipeline_parallel_size=args.pipeline_parallel_size)
