"""`pdserve serve MODEL` and `pdserve up` take vLLM's serve flags and hand each to the services
that own its concept: the exact command lines the launcher builds, each parsed back by that
service's own parser, and each service's --help naming the flag."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services import cli, launcher

PDSERVE = Path(sys.executable).parent / "pdserve"
OTLP = "http://127.0.0.1:4317"
# every vLLM serve flag pdserve has, as a user would type them
VLLM_FLAGS = ["--dtype", "float32", "--served-model-name", "tiny", "tiny-alias",
              "--max-model-len", "256", "--block-size", "32", "--max-num-seqs", "8",
              "--max-num-batched-tokens", "512", "--no-enable-prefix-caching",
              "--api-key", "sk-test", "--seed", "7", "--generation-config", "vllm",
              "--otlp-traces-endpoint", OTLP, "--gpu-memory-utilization", "0.5",
              "--host", "127.0.0.2", "--port", "8123", "--tensor-parallel-size", "1",
              "--num-scheduler-steps", "2"]
# which service's --help must show each (vLLM's name, or the service's own for the same concept)
OWNERS = {
    "gateway": ["--host", "--port", "--served-model-name", "--max-model-len", "--api-key",
                "--generation-config", "--otlp-traces-endpoint"],
    "scheduler": ["--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                  "--enable-prefix-caching", "--no-enable-prefix-caching",
                  "--otlp-traces-endpoint", "--num-scheduler-steps"],
    "prefill-worker": ["--dtype", "--block-size", "--max-num-batched-tokens", "--max-model-len",
                       "--seed", "--gpu-memory-utilization", "--otlp-traces-endpoint"],
    "decode-worker": ["--dtype", "--block-size", "--max-num-batched-tokens", "--max-model-len",
                      "--seed", "--gpu-memory-utilization", "--otlp-traces-endpoint"],
}


def _commands(argv):
    exe = launcher._pdserve()
    cmds = launcher.commands(cli.parse_args(argv))
    assert all(c[:len(exe)] == exe for c in cmds)
    return {c[len(exe)]: c[len(exe) + 1:] for c in cmds}


def test_every_vllm_flag_reaches_its_services_exact_command_line():
    model = "models/some-model"
    cmds = _commands(["serve", model, *VLLM_FLAGS, "--scheduler-port", "50099",
                      "--cpu-threads", "1", "--metrics-port", "-1"])
    sched = "127.0.0.2:50099"
    assert cmds["scheduler"] == [
        "--host", "127.0.0.2", "--port", "50099", "--max-num-seqs", "8",
        "--num-scheduler-steps", "2", "--max-num-batched-tokens", "512", "--max-model-len", "256", "--mode", "disaggregated",
        "--no-enable-prefix-caching", "--otlp-traces-endpoint", OTLP]
    worker = ["--model", model, "--scheduler", sched, "--dtype", "float32", "--block-size", "32",
              "--cpu-threads", "1", "--device", "cpu", "--max-num-batched-tokens", "512",
              "--gpu-memory-utilization", "0.2500",  # the two workers split the stack's 0.5
              "--max-model-len", "256", "--seed", "7", "--otlp-traces-endpoint", OTLP]
    assert cmds["prefill-worker"] == worker + ["--cpu-nice", "19"]
    assert cmds["decode-worker"] == worker
    assert cmds["gateway"] == [
        "--host", "127.0.0.2", "--port", "8123", "--scheduler", sched, "--model", model,
        "--generation-config", "vllm", "--otlp-traces-endpoint", OTLP,
        "--served-model-name", "tiny", "tiny-alias", "--max-model-len", "256",
        "--api-key", "sk-test"]


def test_each_service_parses_what_it_is_given():
    cmds = _commands(["serve", "m", *VLLM_FLAGS, "--metrics-port", "-1"])
    parsed = {role: cli.parse_args([role, *argv]) for role, argv in cmds.items()}
    assert parsed["scheduler"].enable_prefix_caching is False
    assert (parsed["scheduler"].max_num_seqs, parsed["scheduler"].max_model_len) == (8, 256)
    for role in ("prefill-worker", "decode-worker"):
        w = parsed[role]
        assert (w.dtype, w.seed, w.block_size, w.max_model_len) == ("float32", 7, 32, 256)
        assert w.gpu_memory_utilization == 0.25 and w.otlp_traces_endpoint == OTLP
    g = parsed["gateway"]
    assert (g.api_key, g.served_model_name, g.generation_config) == (
        "sk-test", ["tiny", "tiny-alias"], "vllm")
    assert (g.host, g.port, g.max_model_len) == ("127.0.0.2", 8123, 256)


def test_defaults_name_auto_dtype_prefix_caching_and_the_models_generation_config():
    cmds = _commands(["up", "--metrics-port", "-1"])
    assert cmds["scheduler"][cmds["scheduler"].index("--mode") + 2] == "--enable-prefix-caching"
    assert cmds["decode-worker"][cmds["decode-worker"].index("--dtype") + 1] == "auto"
    assert cmds["decode-worker"][cmds["decode-worker"].index("--seed") + 1] == "0"
    gateway = cmds["gateway"]
    assert gateway[gateway.index("--generation-config") + 1] == "auto"
    assert not {"--api-key", "--served-model-name", "--max-model-len"} & set(gateway)
    assert "--gpu-memory-utilization" not in cmds["decode-worker"]  # on a CPU, unless given


def test_up_takes_the_same_flags_as_serve():
    up = _commands(["up", "--model", "m", *VLLM_FLAGS, "--metrics-port", "-1"])
    serve = _commands(["serve", "m", *VLLM_FLAGS, "--metrics-port", "-1"])
    assert up == serve


def test_the_positional_model_wins_over_model_and_defaults_to_it():
    assert cli.parse_args(["serve", "a", "--model", "b"]).model == "a"
    assert cli.parse_args(["serve", "--model", "b"]).model == "b"
    assert cli.parse_args(["serve"]).model == cli.parse_args(["up"]).model


@pytest.mark.parametrize("flags, message", [
    (["-pp", "0"], "--tensor-parallel-size and --pipeline-parallel-size must be >= 1"),
    (["-tp", "0"], "--tensor-parallel-size and --pipeline-parallel-size must be >= 1"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
     "--speculative-config: num_speculative_tokens must be >= 1"),
    (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}'],
     "--speculative-config: unknown method 'eagle'"),
    (["--speculative-config", '{"num_speculative_tokens": 3, "prompt_lookup_mx": 3}'],
     "--speculative-config: unknown keys ['prompt_lookup_mx']"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
])
def test_unbuilt_concepts_are_refused_before_anything_starts(tmp_path, capsys, flags, message):
    assert cli.main(["serve", str(tmp_path / "never-read"), *flags]) == 2
    assert f"pdserve serve: {message}" in capsys.readouterr().err


def test_each_services_help_shows_its_flags():
    whole_stack = [f for f in VLLM_FLAGS if f.startswith("-")] + [
        "--enable-prefix-caching", "-tp", "--speculative-config"]
    for service, flags in [*OWNERS.items(), ("serve", whole_stack), ("up", whole_stack)]:
        out = subprocess.run([str(PDSERVE), service, "--help"], capture_output=True, text=True,
                             timeout=120, check=True).stdout
        for flag in flags:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", out), \
                f"`pdserve {service} --help` lacks {flag}"


def test_a_services_parser_loads_no_serving_module():
    """`pdserve SERVICE --help` answers at once: building any service's parser imports neither
    torch nor transformers nor xgrammar (those load when the service starts)."""
    heavy = ("torch", "transformers", "xgrammar")
    code = ("import sys; from services import cli\n"
            f"for name in {sorted(cli.SERVICES)!r}: cli.build_parser([name])\n"
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True, cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("flag", ["--keepalive-time", "--keepalive-timeout"])
def test_scheduler_keepalive_flags_refuse_non_positive_values(flag):
    import argparse

    from services.scheduler.main import add_arguments, config_from_args
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert config_from_args(p.parse_args([flag, "0.5"])) is not None
    with pytest.raises(ValueError, match="positive"):
        config_from_args(p.parse_args([flag, "0"]))
