"""`--dtype auto`: the dtype a worker serves a checkpoint in, and why.

    GPU: the checkpoint's torch_dtype (float32 when it names none, as for a GGUF file);
         a bfloat16 checkpoint on a GPU without bf16 arithmetic runs in float16
    CPU: bfloat16 where the CPU computes it natively (avx512_bf16 or amx_bf16), else float32:
         emulated bf16 converts every operand and is slower than float32, not faster

vLLM's spellings are accepted ("half", "float"); every other name is refused.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DTYPES = ("float32", "float16", "bfloat16")
ALIASES = {"half": "float16", "float": "float32"}
CHOICES = ("auto", *DTYPES, *ALIASES)  # what --dtype takes
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo's names of native bf16 arithmetic
CPUINFO = Path("/proc/cpuinfo")

_logged: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str   # one of DTYPES
    reason: str  # why, for the log


def canonical(name: str) -> str:
    """A --dtype value in DTYPES' spelling (or "auto"); ValueError for anything else."""
    name = ALIASES.get(name, name)
    if name != "auto" and name not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(CHOICES)}, not {name!r}")
    return name


def resolve_dtype(requested: str, model: str, device: str,
                  cpu_flags: Callable[[], frozenset[str]] | None = None,
                  gpu_has_bf16: Callable[[str], bool] | None = None) -> DtypeChoice:
    """The dtype to serve `model` in on `device` ("cpu", "cuda", "cuda:N"). `cpu_flags` and
    `gpu_has_bf16` probe the hardware (default: this host's); they are asked only when needed."""
    requested = canonical(requested)
    if requested != "auto":
        return DtypeChoice(requested, "given by --dtype")
    if device.split(":")[0] == "cpu":
        flags = (cpu_flags or host_cpu_flags)()
        native = ", ".join(f for f in BF16_CPU_FLAGS if f in flags)
        if native:
            return DtypeChoice("bfloat16", f"this CPU computes bf16 natively ({native})")
        wanted = " or ".join(BF16_CPU_FLAGS)
        return DtypeChoice("float32", f"this CPU has no native bf16 ({wanted})")
    named = checkpoint_dtype(model)
    if named is None:
        return DtypeChoice("float32", "the checkpoint names no torch_dtype")
    if named == "bfloat16" and not (gpu_has_bf16 or _gpu_has_bf16)(device):
        return DtypeChoice("float16", f"the checkpoint is bfloat16 but {device} has no bf16")
    return DtypeChoice(named, "the checkpoint's torch_dtype")


def log_choice(choice: DtypeChoice) -> None:
    """Once per process for each choice, however many configs make it."""
    if (choice.dtype, choice.reason) not in _logged:
        _logged.add((choice.dtype, choice.reason))
        log.info("dtype %s: %s", choice.dtype, choice.reason)


def checkpoint_dtype(model: str | Path) -> str | None:
    """config.json's torch_dtype (or `dtype`, as newer transformers write it; or under
    text_config) when it is one of DTYPES; None for a GGUF file or a directory without one."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    for section in (config, config.get("text_config") or {}):
        for key in ("torch_dtype", "dtype"):
            if section.get(key) in DTYPES:
                return str(section[key])
    return None


def host_cpu_flags() -> frozenset[str]:
    """The kernel's CPU flags (it lists only what the OS has enabled, e.g. AMX state); off Linux,
    torch's own probes of the same instructions."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        import torch
        probes = {"avx512_bf16": torch.cpu._is_avx512_bf16_supported,
                  "amx_bf16": torch.cpu._is_amx_tile_supported}
        return frozenset(name for name, probe in probes.items() if probe())
    line = next((li for li in text.splitlines() if li.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def _gpu_has_bf16(device: str) -> bool:
    import torch
    return torch.cuda.get_device_capability(device) >= (8, 0)  # Ampere on
