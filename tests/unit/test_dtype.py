"""--dtype auto: the hardware's and the checkpoint's answers, probed through injected functions."""
import json
import logging

import pytest
import torch

from common.models import dtype as dtypes
from common.worker.config import WorkerConfig


def _flags(*names):
    return lambda: frozenset(names)


def _gpu(has_bf16):
    return lambda device: has_bf16


def _checkpoint(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("flags, want", [
    (("fpu", "avx2", "fma"), "float32"),
    (("avx2", "avx512f", "avx512bw"), "float32"),  # AVX-512 without its bf16 extension
    (("avx512f", "avx512_bf16"), "bfloat16"),
    (("avx2", "amx_tile", "amx_bf16"), "bfloat16"),
])
def test_auto_on_a_cpu_is_bf16_only_where_it_is_native(tmp_path, flags, want):
    model = _checkpoint(tmp_path, torch_dtype="bfloat16")  # the checkpoint does not decide on CPU
    choice = dtypes.resolve_dtype("auto", model, "cpu", cpu_flags=_flags(*flags))
    assert choice.dtype == want
    if want == "bfloat16":
        assert choice.reason.startswith("this CPU computes bf16 natively (")
    else:
        assert choice.reason == "this CPU has no native bf16 (avx512_bf16 or amx_bf16)"


@pytest.mark.parametrize("config, has_bf16, want", [
    ({"torch_dtype": "bfloat16"}, True, "bfloat16"),
    ({"torch_dtype": "bfloat16"}, False, "float16"),
    ({"torch_dtype": "float16"}, False, "float16"),
    ({"torch_dtype": "float32"}, True, "float32"),
    ({"dtype": "bfloat16"}, True, "bfloat16"),                       # newer transformers' key
    ({"text_config": {"torch_dtype": "float16"}}, True, "float16"),  # multimodal layout
    ({}, True, "float32"),
    ({"torch_dtype": "float8_e4m3fn"}, True, "float32"),
])
def test_auto_on_a_gpu_is_the_checkpoints_dtype(tmp_path, config, has_bf16, want):
    model = _checkpoint(tmp_path, **config)
    probed = []

    def no_cpu_probe():
        probed.append("cpu")
        return frozenset()

    choice = dtypes.resolve_dtype("auto", model, "cuda:1", cpu_flags=no_cpu_probe,
                                  gpu_has_bf16=_gpu(has_bf16))
    assert choice.dtype == want and not probed


def test_a_gguf_file_names_no_dtype(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert dtypes.checkpoint_dtype(gguf) is None
    assert dtypes.resolve_dtype("auto", str(gguf), "cuda", gpu_has_bf16=_gpu(True)).dtype == \
        "float32"


@pytest.mark.parametrize("given, want", [
    ("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
    ("half", "float16"), ("float", "float32"),
])
def test_an_explicit_dtype_is_kept_without_probing(given, want):
    def never():
        raise AssertionError("an explicit dtype probes nothing")

    choice = dtypes.resolve_dtype(given, "no-such-model", "cpu", cpu_flags=never)
    assert choice == dtypes.DtypeChoice(want, "given by --dtype")


def test_unknown_dtypes_are_refused():
    with pytest.raises(ValueError, match="--dtype must be one of auto, float32"):
        dtypes.canonical("fp8")
    with pytest.raises(ValueError, match="--dtype must be one of"):
        WorkerConfig(role="decode", model="m", dtype="int8")


def test_host_flags_agree_with_torchs_probe():
    flags = dtypes.host_cpu_flags()
    assert "avx512_bf16" in flags if torch.cpu._is_avx512_bf16_supported() else \
        "avx512_bf16" not in flags


def test_worker_config_resolves_auto_once_and_logs_why(tiny_llama, caplog, monkeypatch):
    monkeypatch.setattr(dtypes, "_logged", set())
    want = dtypes.resolve_dtype("auto", str(tiny_llama), "cpu")
    with caplog.at_level(logging.INFO, logger="common.models.dtype"):
        configs = [WorkerConfig(role=r, model=str(tiny_llama), device="cpu")
                   for r in ("prefill", "decode")]
    assert [c.dtype for c in configs] == [want.dtype] * 2
    assert want.dtype in ("float32", "bfloat16")
    assert [r.getMessage() for r in caplog.records] == [f"dtype {want.dtype}: {want.reason}"]
    assert WorkerConfig(role="decode", model="m", dtype="half").dtype == "float16"
