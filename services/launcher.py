"""`pdserve up` (and `pdserve serve MODEL`): the whole stack on one host, each service its own
process started with the same command a user would type for it. Ctrl-C (or SIGTERM) stops all of
them. Flags named like vLLM's go to the services that own the concept:

    gateway          --host --port --served-model-name --max-model-len --api-key
                     --generation-config --otlp-traces-endpoint
    scheduler        --max-num-seqs --max-num-batched-tokens --max-model-len
                     --[no-]enable-prefix-caching --otlp-traces-endpoint
    prefill/decode   --dtype --block-size --max-num-batched-tokens --max-model-len --seed
    workers          --gpu-memory-utilization (split between the workers) --otlp-traces-endpoint

It lives in services/ with the CLI because it starts the services: common/ never reaches up.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.models import dtype as dtypes
from common.ports import free_ports
from common.tls import (
    CA_FILE,
    ROLES,
    TLSFiles,
    grpc_channel_credentials,
    make_certs,
    scheduler_channel_options,
)
from common.worker.speculative import SpeculativeConfig
from services.gateway.tools import PARSERS

DEFAULT_MODEL = "models/tiny-llama"
GPU_MEMORY_SHARE = 0.9  # of one GPU's memory, split between the workers `pdserve up` puts on it
PREFILL_NICE = 19       # the lowest CPU priority: prefill takes only what decoding leaves


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("PDSERVE_MODEL", DEFAULT_MODEL),
                   help=f"checkpoint directory; the embedded tiny model is made at {DEFAULT_MODEL} "
                        "when that default is missing")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API accepts; the first is reported (default: the "
                        "model as given)")
    p.add_argument("--host", default="127.0.0.1", help="address every service binds")
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port")
    p.add_argument("--scheduler-port", type=int, default=50051, help="scheduler gRPC port")
    p.add_argument("--gateways", type=int, default=1,
                   help="gateway processes serving --port (`pdserve gateway --workers`)")
    p.add_argument("--prefill-workers", type=int, default=1, help="prefill-worker processes")
    p.add_argument("--decode-workers", type=int, default=1, help="decode-worker processes")
    p.add_argument("--cpu-threads", type=int, default=0,
                   help="torch threads per worker at start; 0: every core when the workers share "
                        "them (the scheduler then sets each step's threads), else each worker's "
                        "part")
    p.add_argument("--dtype", choices=dtypes.CHOICES, default="auto",
                   help="weights and KV cache dtype of the workers; auto: the checkpoint's "
                        "torch_dtype on a GPU, on a CPU bfloat16 where it computes bf16 natively, "
                        "else float32 (each worker logs its choice)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, default=0,
                   help="KV blocks per worker; 0 sizes them from the workers' default memory")
    p.add_argument("--kv-offloading-size", type=float, default=0.0, metavar="GIB",
                   help="a second KV tier of this many GiB of host memory per worker: blocks "
                        "its cache evicts are kept there and prefix hits in it copied back "
                        "instead of recomputed; 0: none")
    p.add_argument("--kv-offloading-backend", choices=["native", "host"], default="native",
                   help="native: each worker's own tier; host: one tier the workers share")
    p.add_argument("--max-num-seqs", type=int, default=256, help="see `pdserve scheduler`")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode steps a plan that only decodes runs on its worker (see `pdserve "
                        "scheduler`)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="see `pdserve scheduler`")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="context length (prompt plus completion); 0: the model's")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of prompts' common prefixes (see `pdserve scheduler`)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer <key>` on the API (default: the "
                        "gateway's $PDSERVE_API_KEY)")
    p.add_argument("--seed", type=int, default=0, help="the workers' seed of unseeded sampling")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults: auto (the model's generation_config.json), vllm "
                        "(none), or a directory holding one (see `pdserve gateway`)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of the GPU's memory the workers on it may use in all, split "
                        f"evenly between them (default on a GPU: {GPU_MEMORY_SHARE})")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="every worker a group of this many rank processes splitting the model "
                        "(CPU workers, gloo; KV between groups over shm); a pool of another "
                        "size: --prefill-worker-args / --decode-worker-args")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="every worker's layers split over this many stages of "
                        "--tensor-parallel-size ranks each (CPU workers, gloo)")
    p.add_argument("--speculative-config", default="",
                   help="speculative decoding on the decode workers (those that decode, in "
                        "either mode), vLLM's JSON: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'")
    p.add_argument("--structured-outputs-config", default="",
                   help="see `pdserve gateway`: vLLM's JSON object (backend, "
                        "disable_any_whitespace)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="see `pdserve gateway`")
    p.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                   help="see `pdserve gateway`")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated",
                   help="colocated: no prefill workers; the decode workers do both phases")
    p.add_argument("--scheduler-args", default="",
                   help="more `pdserve scheduler` flags, as one string "
                        "(e.g. \"--max-num-partial-prefills 4 --no-enable-prefix-caching\")")
    p.add_argument("--device", default="cpu",
                   help="where the workers keep the model and KV cache: cpu | cuda | auto; on a "
                        "GPU the workers split 90%% of its memory and send KV over cuda_ipc")
    p.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=False,
                   help="give each worker its own cores (when there are enough): a static split, "
                        "where the cores of an idle phase idle. Default: CPU workers share every "
                        "core; each step's threads follow who is busy, and prefill workers run at "
                        "the lowest CPU priority so that decoding never waits for them")
    p.add_argument("--prefill-worker-args", default="",
                   help="more `pdserve prefill-worker` flags, as one string")
    p.add_argument("--decode-worker-args", default="",
                   help="more `pdserve decode-worker` flags, as one string")
    p.add_argument("--max-restarts", "--max-worker-restarts", type=int, default=10,
                   dest="max_restarts",
                   help="services that die (a worker, the scheduler, the gateway) are "
                        "restarted, this many times in all")
    p.add_argument("--ready-timeout", type=float, default=180.0,
                   help="seconds to wait for every service to come up")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="/metrics of the scheduler on this port and of the workers on the next "
                        "ones (the gateway serves /metrics on --port); 0: free ports; -1: off")
    p.add_argument("--otlp-traces-endpoint", default=None,
                   help="OTLP/gRPC trace collector every service exports to, e.g. "
                        "http://127.0.0.1:4317 (default: the OTEL_EXPORTER_OTLP_* env vars)")
    p.add_argument("--detailed-traces", action="store_true",
                   help="workers add a span per decode step of every request")
    p.add_argument("--tls-dir", default=os.environ.get("PDSERVE_TLS_DIR", ""),
                   help="mutual TLS between the services with this directory's certificates "
                        "(`pdserve make-certs`; written there first when it holds no ca.crt); "
                        "empty: in the clear (env PDSERVE_TLS_DIR)")


def unbuilt(args) -> str | None:
    """Why a flag cannot be honoured, for vLLM flags whose concept is not built yet (refused,
    never silently ignored), or None."""
    if args.tensor_parallel_size < 1 or args.pipeline_parallel_size < 1:
        return "--tensor-parallel-size and --pipeline-parallel-size must be >= 1"
    try:
        SpeculativeConfig.parse(args.speculative_config)
    except ValueError as e:
        return str(e)
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        return "--gpu-memory-utilization must be in (0, 1]"
    return None


def _pdserve() -> list[str]:
    script = Path(sys.executable).parent / "pdserve"
    if script.exists():
        return [str(script)]
    found = shutil.which("pdserve")
    return [found] if found else [sys.executable, "-m", "services.cli"]


def _core_sets(num_workers: int) -> list[list[str]]:
    """Disjoint `--cpu-cores` per worker when this host has a core for each, else none."""
    cores = sorted(os.sched_getaffinity(0))
    if num_workers == 0 or len(cores) < num_workers:
        return [[]] * num_workers
    per = len(cores) // num_workers
    return [["--cpu-cores", ",".join(map(str, cores[i * per:(i + 1) * per]))]
            for i in range(num_workers)]


def commands(args) -> list[list[str]]:
    exe = _pdserve()
    sched = f"{args.host}:{args.scheduler_port}"
    if args.mode == "colocated":
        args.prefill_workers = 0
    num_workers = args.prefill_workers + args.decode_workers
    shared = not args.pin_cpus and args.device == "cpu"
    num_cores = len(os.sched_getaffinity(0))
    threads = args.cpu_threads or \
        (num_cores if shared else max(1, num_cores // max(1, num_workers)))
    worker = ["--model", args.model, "--scheduler", sched, "--dtype", args.dtype,
              "--block-size", str(args.block_size),
              "--cpu-threads", str(threads), "--device", args.device,
              # the largest step, profiled by a GPU worker before it sizes its KV cache
              "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    gpu_share = args.gpu_memory_utilization
    if gpu_share is None and args.device != "cpu" and \
            "PDSERVE_GPU_MEMORY_UTILIZATION" not in os.environ:
        gpu_share = GPU_MEMORY_SHARE
    if gpu_share is not None and num_workers:
        # the workers share the GPU: each takes its part (a worker's own
        # --gpu-memory-utilization in --prefill/--decode-worker-args comes later and wins)
        worker += ["--gpu-memory-utilization", f"{gpu_share / num_workers:.4f}"]
    cores = _core_sets(num_workers) if args.pin_cpus else [[]] * num_workers
    if args.num_kv_blocks:
        worker += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.kv_offloading_size:
        worker += ["--kv-offloading-size", str(args.kv_offloading_size),
                   "--kv-offloading-backend", args.kv_offloading_backend]
    if args.max_model_len:
        worker += ["--max-model-len", str(args.max_model_len)]
    worker += ["--seed", str(args.seed)]
    if args.tensor_parallel_size != 1:
        worker += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.pipeline_parallel_size != 1:
        worker += ["--pipeline-parallel-size", str(args.pipeline_parallel_size)]
    tracing = ["--otlp-traces-endpoint", args.otlp_traces_endpoint] \
        if args.otlp_traces_endpoint else []
    tls = ["--tls-dir", args.tls_dir] if args.tls_dir else []
    worker += tracing + tls + (["--detailed-traces"] if args.detailed_traces else [])
    group = args.tensor_parallel_size * args.pipeline_parallel_size
    named = _ports_named(args.scheduler_args) + _ports_named(args.prefill_worker_args, group) + \
        _ports_named(args.decode_worker_args, group)
    ports = args.metrics_ports = _metrics_ports(args.metrics_port, 1 + num_workers,
                                                (args.port, args.scheduler_port, *named))
    metrics = [["--metrics-host", args.host, "--metrics-port", str(p)] for p in ports] \
        or [[]] * (1 + num_workers)
    cmds = [exe + ["scheduler", "--host", args.host, "--port", str(args.scheduler_port),
                   "--max-num-seqs", str(args.max_num_seqs),
                   "--num-scheduler-steps", str(args.num_scheduler_steps),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                   "--max-model-len", str(args.max_model_len), "--mode", args.mode,
                   "--enable-prefix-caching" if args.enable_prefix_caching
                   else "--no-enable-prefix-caching",
                   *metrics[0], *tracing, *tls, *shlex.split(args.scheduler_args)]]
    # sharing cores, a prefill step yields them to a decode step that wants them
    yields = ["--cpu-nice", str(PREFILL_NICE)] if shared else []
    cmds += [exe + ["prefill-worker"] + worker + metrics[1 + i] + cores[i] + yields
             + shlex.split(args.prefill_worker_args) for i in range(args.prefill_workers)]
    speculative = ["--speculative-config", args.speculative_config] \
        if args.speculative_config else []
    cmds += [exe + ["decode-worker"] + worker + metrics[1 + args.prefill_workers + i]
             + cores[args.prefill_workers + i] + speculative
             + shlex.split(args.decode_worker_args) for i in range(args.decode_workers)]
    gateway = exe + ["gateway", "--host", args.host, "--port", str(args.port), "--scheduler", sched,
                     "--model", args.model, "--generation-config", args.generation_config,
                     *tracing, *tls]
    if args.served_model_name:
        gateway += ["--served-model-name", *args.served_model_name]
    if args.max_model_len:
        gateway += ["--max-model-len", str(args.max_model_len)]
    if args.api_key:
        gateway += ["--api-key", args.api_key]
    if args.structured_outputs_config:
        gateway += ["--structured-outputs-config", args.structured_outputs_config]
    if args.enable_auto_tool_choice:
        gateway += ["--enable-auto-tool-choice"]
    if args.tool_call_parser:
        gateway += ["--tool-call-parser", args.tool_call_parser]
    if args.gateways != 1:
        gateway += ["--workers", str(args.gateways)]
    return cmds + [gateway]


# Spins of a nice'd worker's OpenMP threads before they sleep: about 0.2 ms, which bridges the
# gaps between one forward's parallel regions (tens of microseconds) but not the idle between
# steps. Fully passive, every region woke its threads from sleep: a 128-token bfloat16 prefill
# of a 56M Llama took 41-48 ms instead of 22-24 (AMD EPYC, 2 cores, AVX-512).
NICE_SPIN_COUNT = 20000


def environment(cmd: list[str]) -> dict[str, str]:
    """A worker running at a lower priority waits only briefly between parallel regions, then
    sleeps, instead of spinning on cores that a decode worker wants (OpenMP reads this at
    start-up; GOMP_SPINCOUNT is GNU OpenMP's, OMP_WAIT_POLICY other runtimes')."""
    env = dict(os.environ)
    if "--cpu-nice" in cmd:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env.setdefault("GOMP_SPINCOUNT", str(NICE_SPIN_COUNT))
    return env


def _ports_named(flags: str, group: int = 1) -> list[int]:
    """The ports named in flags passed through to a service (`--kv-port 31000`,
    `--kv-advertise-port=31001`: any option named --...-port): ports it will bind, or that
    something in front of it does, maybe not bound yet when the stack chooses its metrics
    ports. A worker group's ranks take consecutive KV ports from the one named: `group` ranks,
    or as many as the flags' own --tensor-parallel-size and --pipeline-parallel-size make."""
    words = shlex.split(flags)
    values: dict[str, str] = {}
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        if name.startswith("-"):
            values[name] = value if eq else (words[i + 1] if i + 1 < len(words) else "")
    sizes = [values.get(long, values.get(short, "")) for long, short in
             (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp"))]
    if any(size.isdigit() for size in sizes):
        group = math.prod(int(size) if size.isdigit() else 1 for size in sizes)
    ports: list[int] = []
    for name, value in values.items():
        if name.startswith("--") and name.endswith("-port") and value.isdigit():
            ranks = group if name.startswith("--kv-") else 1
            ports += range(int(value), int(value) + ranks)
    return ports


def _metrics_ports(first: int, n: int, taken: tuple[int, ...]) -> list[int]:
    """n ports from `first` on; 0: n free ones (outside the ephemeral range, so that no
    connection takes one before its service binds it), none of the stack's `taken` ones, which
    may be free yet (their services bind them later); -1: none."""
    if first < 0:
        return []
    if first > 0:
        return list(range(first, first + n))
    return free_ports(n, exclude=taken)


def metrics_urls(args) -> list[tuple[str, str]]:
    """(service, /metrics URL) of every service of the stack."""
    names = ["scheduler"] + [f"prefill-worker-{i}" for i in range(args.prefill_workers)] + \
        [f"decode-worker-{i}" for i in range(args.decode_workers)]
    urls = [("gateway", f"http://{args.host}:{args.port}/metrics")]
    return urls + [(n, f"http://{args.host}:{p}/metrics")
                   for n, p in zip(names, getattr(args, "metrics_ports", []))]


def _wait_ready(args, procs, deadline: float, stopping) -> bool:
    """Every worker registered and the gateway ready (/ready: it sees a worker path)."""
    import grpc
    import httpx

    from protos import scheduler_pb2, scheduler_pb2_grpc

    want = args.prefill_workers + args.decode_workers
    url = f"http://{args.host}:{args.port}/ready"
    address = f"{args.host}:{args.scheduler_port}"
    if args.tls_dir:
        tls = TLSFiles.in_dir(args.tls_dir, "admin")
        channel = grpc.secure_channel(address, grpc_channel_credentials(tls),
                                      options=scheduler_channel_options(tls))
    else:
        channel = grpc.insecure_channel(address)
    with channel as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        while time.monotonic() < deadline and not stopping():
            if any(p.poll() is not None for p in procs):
                return False
            try:
                n = len(stub.Stats(scheduler_pb2.StatsRequest(), timeout=2).workers)
                if n >= want and httpx.get(url, timeout=2).status_code == 200:
                    return True
            except (grpc.RpcError, httpx.HTTPError):
                pass
            time.sleep(0.3)
    return False


def _stop(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """The gateway first (the last process), while the scheduler and the workers still serve
    the streams it drains; then the others. Each group gets `grace` seconds, then SIGKILL."""
    for group in (procs[-1:], procs[:-1]):
        for p in group:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in group:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run(args) -> int:
    refused = unbuilt(args)
    if refused:
        print(f"pdserve {args.command}: {refused}", file=sys.stderr)
        return 2
    if args.model == DEFAULT_MODEL and not Path(DEFAULT_MODEL, "config.json").exists():
        from common.models.tiny import make_tiny_model
        make_tiny_model(DEFAULT_MODEL, arch="llama", seed=0)
    from common.models.gguf import find_gguf
    if not Path(args.model, "config.json").exists() and find_gguf(args.model) is None:
        print(f"pdserve {args.command}: {args.model} is neither a model directory nor a .gguf "
              "file", file=sys.stderr)
        return 2
    if args.tls_dir and not Path(args.tls_dir, CA_FILE).exists():
        make_certs(args.tls_dir)
        print(f"pdserve {args.command}: certificates for mutual TLS written to {args.tls_dir}",
              flush=True)
    if args.tls_dir:
        try:
            for role in ROLES:
                TLSFiles.in_dir(args.tls_dir, role).check()
        except ValueError as e:
            print(f"pdserve {args.command}: {e}", file=sys.stderr)
            return 2
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    cmds = commands(args)
    procs = [subprocess.Popen(cmds[0])]
    try:
        time.sleep(0.5)
        procs += [subprocess.Popen(c, env=environment(c)) for c in cmds[1:]]
        if not _wait_ready(args, procs, time.monotonic() + args.ready_timeout, lambda: stopping):
            if stopping:
                return 0
            print(f"pdserve {args.command}: the stack did not come up", file=sys.stderr)
            return 1
        print(f"pdserve is up: http://{args.host}:{args.port}/v1  model={args.model}  "
              f"({args.prefill_workers} prefill, {args.decode_workers} decode workers)", flush=True)
        print("pdserve metrics: " + "  ".join(f"{n}={u}" for n, u in metrics_urls(args)),
              flush=True)
        restarts = 0
        while not stopping:
            for i, (c, p) in enumerate(zip(cmds, procs)):
                if p.poll() is None:
                    continue
                role = c[len(_pdserve())]
                if restarts >= args.max_restarts:
                    print(f"pdserve {args.command}: `{role}` exited with {p.returncode}; stopping",
                          file=sys.stderr)
                    return 1
                # a worker that dies takes only its own requests down (they are recomputed
                # elsewhere) and registers afresh; a new scheduler gets the workers back (they
                # re-attach) and the gateways' unfinished requests (they resubmit them)
                restarts += 1
                print(f"pdserve {args.command}: `{role}` exited with {p.returncode}; restarting it "
                      f"({restarts}/{args.max_restarts})", file=sys.stderr, flush=True)
                from common.shm_segments import sweep_stale_segments
                sweep_stale_segments()
                procs[i] = subprocess.Popen(c, env=environment(c))
            time.sleep(0.5)
        return 0
    finally:
        _stop(procs)
        from common.shm_segments import sweep_stale_segments
        sweep_stale_segments()  # of a worker that crashed and could not clean up
