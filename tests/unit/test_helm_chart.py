"""The Helm chart (compose/helm) renders with Helm's own template engine: helm-python-sdk embeds
Helm v4's Go SDK (no package registry ships a helm binary). Every manifest validates against
the Kubernetes schemas (kubernetes-validate, strict: an unknown field fails) of the oldest
release the chart allows and of the newest one bundled. The CRDs (LeaderWorkerSet,
ServiceMonitor) have no schema there: their pod templates are validated as core PodTemplates and
their own fields against the names their APIs define.

What the containers run is checked by pdserve itself: each container's args, with its env set
and $(VAR) expanded as the kubelet does, go through the CLI's own parser (a flag no service
takes fails) and into the services' config objects. Probes and Services point at ports the
containers listen on; values change worker counts, resources and GPU scheduling; the KV secret
reaches every worker; the dashboard ConfigMap holds the dashboard file byte for byte."""
from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import functools
import io
import json
import os
import re
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

from common.tls import (
    ROLES,
    TLSFiles,
    grpc_channel_credentials,
    grpc_server_credentials,
    kv_client_context,
    kv_server_context,
    make_certs,
)
from services.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "compose" / "helm"
DASHBOARD = CHART / "dashboards" / "pdserve.json"
RELEASE, NAMESPACE = "pdserve", "llm"
SCHEDULER_API = "pdserve.scheduler.Scheduler"  # the scheduler's health service of its API
WORKER_ROLES = {"prefill-worker": "prefill", "decode-worker": "decode"}
# what the LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) and ServiceMonitor
# (monitoring.coreos.com/v1) APIs name; no Kubernetes schema covers a CRD
LWS_SPEC = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy",
            "networkConfig"}
LWS_TEMPLATE = {"leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy",
                "volumeClaimTemplates", "persistentVolumeClaimRetentionPolicy"}
LWS_RESTART = {"Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"}
MONITOR_SPEC = {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels",
                "podTargetLabels", "sampleLimit"}
MONITOR_ENDPOINT = {"port", "targetPort", "path", "scheme", "interval", "scrapeTimeout",
                    "relabelings", "metricRelabelings", "honorLabels"}

GPU_VALUES = yaml.safe_load((CHART / "values-gpu.yaml").read_text())
CASES = {
    "default": {},
    "gpu": GPU_VALUES,
    "colocated": {"prefill": {"replicas": 0}, "decode": {"replicas": 3}},
    "many-workers": {"prefill": {"replicas": 4}, "decode": {"replicas": 2}},
    "lws": {"leaderWorkerSet": {"enabled": True}, "gpu": {"enabled": True},
            "metrics": {"serviceMonitor": {"enabled": True}}},
    "existing-model": {"model": {"source": "existing", "path": "Llama-3.1-8B-Instruct",
                                 "existingClaim": "models"},
                       "gateway": {"autoscaling": {"enabled": False}, "replicas": 3,
                                   "apiKeySecret": {"name": "api"}},
                       "otlp": {"endpoint": "http://jaeger-collector:4317"}},
    "tiny-model": {"model": {"source": "tiny", "name": "tiny-llama"},
                   "kvSecret": {"existingSecret": "mine", "key": "k"},
                   "tls": {"existingSecret": "pdserve-certs"}},
    "no-tls": {"tls": {"enabled": False}},
    "host-path": {"model": {"hostPath": "/data/models"},
                  "decode": {"extraArgs": ["--max-num-batched-tokens", "4096"]},
                  "scheduler": {"extraArgs": ["--max-num-seqs", "64"]}},
}


def render(values: dict | None = None) -> list[dict]:
    """The chart's manifests, as `helm template pdserve compose/helm -n llm` prints them (a
    copy each call: a test may change what it gets)."""
    return copy.deepcopy(_rendered(json.dumps(values or {}, sort_keys=True)))


@functools.cache
def _rendered(values: str) -> list[dict]:
    """Rendered once per set of values (~0.6 s each, asked for ~30 times in this module)."""
    with helm_python.Chart.load(CHART) as chart:
        out = chart.render(json.loads(values), name=RELEASE, namespace=NAMESPACE)
    return [doc for path, text in sorted(out.items()) if path.endswith(".yaml")
            for doc in yaml.load_all(text, Loader=yaml.CSafeLoader) if doc]


def kind(docs: list[dict], k: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == k}


def one(docs: list[dict], k: str, suffix: str) -> dict:
    (doc,) = [d for name, d in kind(docs, k).items() if name.endswith(suffix)]
    return doc


def pod_template(workload: dict) -> dict:
    if workload["kind"] == "LeaderWorkerSet":
        return workload["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    return workload["spec"]["template"]


def workloads(docs: list[dict]) -> dict[str, dict]:
    """Component (gateway, scheduler, prefill-worker, decode-worker) -> its workload."""
    out = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "LeaderWorkerSet"):
            component = pod_template(d)["metadata"]["labels"]["app.kubernetes.io/component"]
            assert component not in out, component
            out[component] = d
    return out


def quantity(q) -> float:
    """A Kubernetes quantity in bytes or cores: 1280Mi, 4Gi, 500m, "2"."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3, "k": 1e3,
             "M": 1e6, "G": 1e9}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    assert m, q
    return float(m.group(1)) * units.get(m.group(2), 1)


# ---- what a container runs -------------------------------------------------------------------

def container_env(container: dict) -> dict[str, str]:
    """Its environment, what the kubelet fills in at run time as a readable placeholder."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = f"<{e['valueFrom']['fieldRef']['fieldPath']}>"
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = f"<secret {ref['name']}/{ref['key']}>"
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    """$(VAR) as the kubelet expands it in args: defined variables only; $$ escapes."""
    return re.sub(r"\$\$|\$\((\w+)\)",
                  lambda m: "$" if m.group() == "$$" else env.get(m.group(1), m.group()), arg)


def run_args(container: dict, monkeypatch) -> argparse.Namespace:
    """The argparse namespace pdserve's own CLI makes of the container's command; a flag or
    value it does not take fails the test with argparse's message."""
    assert container["command"] == ["pdserve"], container["name"]
    env = container_env(container)
    args = [expand(a, env) for a in container["args"]]
    with monkeypatch.context() as m:  # the container's environment only, as its defaults see it
        for name in [n for n in os.environ if n.startswith(("PDSERVE_", "OTEL_"))]:
            m.delenv(name)
        for name, value in env.items():
            m.setenv(name, value)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                return build_parser(args).parse_args(args)
        except SystemExit:
            pytest.fail(f"{container['name']}: pdserve rejects {args}:\n{err.getvalue()}")


def service_config(component: str, args):
    """The service's own config object from the parsed flags: its validation runs."""
    if component == "scheduler":
        from services.scheduler.main import config_from_args
        return config_from_args(args)
    from common.worker.config import config_from_args as worker_config
    args.dtype = "float32" if args.dtype == "auto" else args.dtype  # "auto" reads the model
    return worker_config(WORKER_ROLES[component], args)


TLS_DIR = "/etc/pdserve/tls"


def mounted_tls(docs: list[dict], spec: dict, container: dict, tmp: Path) -> str:
    """The files the container finds at its TLS mount, written to `tmp` from the Secret the chart
    rendered (an existingSecret: from `pdserve make-certs`, as the user made it); "" without TLS.
    Checks that the pod mounts its own role's key and no other."""
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    if TLS_DIR not in mounts:
        return ""
    (volume,) = [v for v in spec["volumes"] if v["name"] == mounts[TLS_DIR]]
    items = {i["key"]: i["path"] for i in volume["secret"]["items"]}
    (role,) = {k.split(".")[0] for k in items} - {"ca"}
    assert items == {"ca.crt": "ca.crt", f"{role}.crt": f"{role}.crt",
                     f"{role}.key": f"{role}.key"}
    tmp.mkdir(parents=True, exist_ok=True)
    rendered = kind(docs, "Secret").get(volume["secret"]["secretName"])
    if rendered is None:
        source = tmp / "made"
        if not source.exists():
            make_certs(source)
        data = {k: (source / k).read_bytes() for k in items}
    else:
        data = {k: base64.b64decode(rendered["data"][k]) for k in items}
    for key, path in items.items():
        (tmp / path).write_bytes(data[key])
    return str(tmp)


def listening_ports(args) -> set[int]:
    """Ports a service binds, from its parsed flags."""
    return {getattr(args, f) for f in ("port", "health_port", "metrics_port", "kv_port")
            if getattr(args, f, 0)}


def container_port(container: dict, port) -> int:
    """A probe's or Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


# ---- the tests -------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=sorted(CASES))
def case(request) -> tuple[str, list[dict]]:
    return request.param, render(CASES[request.param])


def kube_versions() -> list[str]:
    """The oldest Kubernetes the chart allows (Chart.yaml kubeVersion), the newest bundled."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    oldest = re.fullmatch(r">=\s*(\d+\.\d+)\.\d+(-0)?", chart["kubeVersion"]).group(1)
    return [oldest, kubernetes_validate.utils.latest_version()]


def validate_crd(doc: dict, version: str) -> None:
    """A CRD object: its pod templates as core PodTemplates, its own fields by name."""
    spec = doc["spec"]
    if doc["kind"] == "LeaderWorkerSet":
        assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        assert set(spec) <= LWS_SPEC and set(spec["leaderWorkerTemplate"]) <= LWS_TEMPLATE
        assert spec["leaderWorkerTemplate"]["restartPolicy"] in LWS_RESTART
        assert spec["startupPolicy"] in ("LeaderCreated", "LeaderReady")
        assert spec["rolloutStrategy"]["type"] == "RollingUpdate"
        assert set(spec["rolloutStrategy"]["rollingUpdateConfiguration"]) <= {
            "partition", "maxUnavailable", "maxSurge"}
        for name in ("leaderTemplate", "workerTemplate"):
            if name in spec["leaderWorkerTemplate"]:
                template = {"apiVersion": "v1", "kind": "PodTemplate",
                            "metadata": {"name": f"{doc['metadata']['name']}-{name}"},
                            "template": spec["leaderWorkerTemplate"][name]}
                kubernetes_validate.validate(template, version, strict=True)
    else:
        assert doc["kind"] == "ServiceMonitor"
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(spec) <= MONITOR_SPEC
        assert all(set(e) <= MONITOR_ENDPOINT for e in spec["endpoints"])


def test_every_manifest_validates_against_the_kubernetes_schemas(case):
    name, docs = case
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap"} <= kinds, name
    for version in kube_versions():
        for doc in docs:
            where = f"{name}: {doc['kind']}/{doc['metadata']['name']} against {version}"
            assert doc["metadata"]["name"].startswith(RELEASE), where
            if doc["kind"] in ("LeaderWorkerSet", "ServiceMonitor"):
                validate_crd(doc, version)
                continue
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")


def test_the_schema_check_fails_on_broken_manifests():
    """The validation above can fail: a misspelt field, a wrong type, a missing one."""
    version = kube_versions()[0]
    scheduler = one(render(), "Deployment", "-scheduler")
    kubernetes_validate.validate(scheduler, version, strict=True)
    typo = json.loads(json.dumps(scheduler))
    typo["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grpc"]["servce"] = "x"
    wrong_type = json.loads(json.dumps(scheduler))
    wrong_type["spec"]["replicas"] = "one"
    missing = json.loads(json.dumps(scheduler))
    del missing["spec"]["selector"]
    for broken in (typo, wrong_type, missing):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, version, strict=True)


def test_helm_lint_finds_nothing():
    for values in ({}, GPU_VALUES):
        report = helm_python.lint(CHART, values, strict=True,
                                  kube_version=f"v{kube_versions()[0]}.0")
        serious = [m for m in report["messages"] if m["severity"] >= 2]
        assert not report["errors"] and not serious, report


def test_containers_run_flags_the_services_accept(case, monkeypatch, tmp_path):
    name, docs = case
    found = workloads(docs)
    assert set(found) == {"gateway", "scheduler", "prefill-worker", "decode-worker"}, name
    scheduler_svc = one(docs, "Service", "-scheduler")
    (grpc_port,) = [p["port"] for p in scheduler_svc["spec"]["ports"] if p["name"] == "grpc"]
    scheduler_address = f"{scheduler_svc['metadata']['name']}:{grpc_port}"
    for component, workload in found.items():
        spec = pod_template(workload)["spec"]
        (container,) = spec["containers"]
        args = run_args(container, monkeypatch)
        assert args.command == component
        assert args.tls_dir == (TLS_DIR if name != "no-tls" else ""), (name, component)
        args.tls_dir = mounted_tls(docs, spec, container, tmp_path / component)
        if component == "scheduler":
            assert service_config(component, args).tls is not None or name == "no-tls"
            continue
        assert args.scheduler == scheduler_address, (name, component)
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/models"] == "models" and args.model.startswith("/models/")
        for init in spec.get("initContainers", []):  # what puts the model there
            init_args = run_args(init, monkeypatch)
            assert init_args.command in ("fetch-model", "make-tiny-model")
            assert init_args.dir == args.model, (name, component)
        if component == "gateway":
            continue
        cfg = service_config(component, args)
        assert (cfg.tls is None) == (name == "no-tls")
        assert cfg.kv_transports == ("tcp",)  # pods share no memory: shm and cuda_ipc never
        assert (cfg.kv_host, cfg.kv_advertise_host) == ("0.0.0.0", "<status.podIP>")
        assert cfg.health_host == "0.0.0.0" and cfg.metrics_host == "0.0.0.0"
        assert cfg.health_port and cfg.kv_port and cfg.metrics_port


def service_links(docs: list[dict]) -> dict[str, str]:
    """What the kubelet puts in a pod's env for every Service of its namespace unless
    enableServiceLinks is false (NAME_SERVICE_HOST, NAME_PORT=tcp://..., ...)."""
    env = {}
    for name, svc in kind(docs, "Service").items():
        prefix, port = name.upper().replace("-", "_"), svc["spec"]["ports"][0]["port"]
        env |= {f"{prefix}_SERVICE_HOST": "10.0.0.1", f"{prefix}_SERVICE_PORT": str(port),
                f"{prefix}_PORT": f"tcp://10.0.0.1:{port}"}
    return env


def test_no_pod_gets_service_links(monkeypatch):
    """A release named pdserve has a Service pdserve-scheduler, whose link PDSERVE_SCHEDULER_PORT
    (tcp://IP:PORT) is the env default of the scheduler's --port: it could not start."""
    docs = render()
    for component, workload in workloads(docs).items():
        assert pod_template(workload)["spec"]["enableServiceLinks"] is False, component
    (scheduler,) = pod_template(workloads(docs)["scheduler"])["spec"]["containers"]
    linked = {**scheduler, "env": scheduler["env"] + [{"name": k, "value": v}
                                                      for k, v in service_links(docs).items()]}
    with pytest.raises(ValueError, match="tcp://"):
        run_args(linked, monkeypatch)


def test_a_flag_no_service_takes_fails(monkeypatch):
    """The check above can fail: a misspelt flag, a model `pdserve fetch-model` does not know."""
    docs = render({"decode": {"extraArgs": ["--max-num-batch-tokens", "4096"]}})
    (worker,) = pod_template(workloads(docs)["decode-worker"])["spec"]["containers"]
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments"):
        run_args(worker, monkeypatch)
    docs = render({"model": {"name": "no-such-model"}})
    (init,) = pod_template(workloads(docs)["gateway"])["spec"]["initContainers"]
    with pytest.raises(pytest.fail.Exception, match="invalid choice"):
        run_args(init, monkeypatch)


def test_probes_and_services_reach_listening_ports(case, monkeypatch):
    name, docs = case
    found = workloads(docs)
    for component, workload in found.items():
        template = pod_template(workload)
        (container,) = template["spec"]["containers"]
        args = run_args(container, monkeypatch)
        ports = listening_ports(args)
        assert {p["containerPort"] for p in container["ports"]} == ports, (name, component)
        probes = {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
        assert len(probes) == 3
        for kind_, probe in probes.items():
            if component == "gateway":  # HTTP: /health liveness, /ready readiness
                path = "/ready" if kind_ == "readinessProbe" else "/health"
                assert probe["httpGet"]["path"] == path
                assert container_port(container, probe["httpGet"]["port"]) == args.port
            else:  # Kubernetes' own gRPC probe, grpc.health.v1
                assert set(probe) - {"periodSeconds", "failureThreshold"} == {"grpc"}
                port = probe["grpc"]["port"]
                if component == "scheduler":  # its API (under TLS on the health port)
                    want = args.health_port if args.tls_dir else args.port
                    assert (port, probe["grpc"]["service"]) == (want, SCHEDULER_API)
                else:
                    assert port == args.health_port and "service" not in probe["grpc"]
        annotations = template["metadata"].get("annotations", {})
        metrics_port = args.port if component == "gateway" else args.metrics_port
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == metrics_port
    labels = {c: pod_template(w)["metadata"]["labels"] for c, w in found.items()}
    services = kind(docs, "Service")
    assert len(services) == 4, name
    for svc in services.values():
        selector = svc["spec"]["selector"]
        (component,) = [c for c, lab in labels.items() if selector.items() <= lab.items()]
        (container,) = pod_template(found[component])["spec"]["containers"]
        ports = listening_ports(run_args(container, monkeypatch))
        for p in svc["spec"]["ports"]:
            assert container_port(container, p["targetPort"]) in ports, (svc["metadata"], p)


@pytest.mark.parametrize("prefill,decode", [(1, 1), (0, 2), (3, 5)])
def test_worker_counts_follow_the_values(prefill, decode, monkeypatch):
    for lws in (False, True):
        found = workloads(render({"prefill": {"replicas": prefill},
                                  "decode": {"replicas": decode},
                                  "leaderWorkerSet": {"enabled": lws}}))
        assert found["prefill-worker"]["spec"]["replicas"] == prefill
        assert found["decode-worker"]["spec"]["replicas"] == decode
        kinds = {found[c]["kind"] for c in WORKER_ROLES}
        assert kinds == {"LeaderWorkerSet" if lws else "Deployment"}
        (scheduler,) = pod_template(found["scheduler"])["spec"]["containers"]
        mode = run_args(scheduler, monkeypatch).mode  # no prefill pool: decode workers prefill
        assert mode == ("colocated" if prefill == 0 else "disaggregated")


def test_cpu_profile_gives_whole_cores_and_room_for_the_kv_cache(monkeypatch):
    docs = render()
    for component in WORKER_ROLES:
        spec = pod_template(workloads(docs)[component])["spec"]
        (container,) = spec["containers"]
        args = run_args(container, monkeypatch)
        resources = container["resources"]
        assert args.device == "cpu" and args.cpu_threads >= 1
        assert quantity(resources["limits"]["cpu"]) == args.cpu_threads  # a thread per core
        assert resources["requests"] == resources["limits"]               # Guaranteed
        assert "nvidia.com/gpu" not in resources["limits"]
        assert "nodeSelector" not in spec and "tolerations" not in spec
        # the KV cache is a /dev/shm file: the memory-backed volume there must hold it
        (shm,) = [v for v in spec["volumes"] if v["name"] == "shm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert quantity(shm["emptyDir"]["sizeLimit"]) > args.kv_cache_memory_mib * 2**20
        assert quantity(resources["limits"]["memory"]) > quantity(shm["emptyDir"]["sizeLimit"])


def test_gpu_values_put_the_workers_on_gpus(monkeypatch):
    found = workloads(render(GPU_VALUES))
    for component in WORKER_ROLES:
        spec = pod_template(found[component])["spec"]
        (container,) = spec["containers"]
        args = run_args(container, monkeypatch)
        assert args.device == "cuda" and args.gpu_memory_utilization == 0.9
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists",
                "effect": "NoSchedule"} in spec["tolerations"]
    for component in ("gateway", "scheduler"):  # no GPU, and kept off the GPU nodes
        spec = pod_template(found[component])["spec"]
        assert "nvidia.com/gpu" not in str(spec["containers"][0]["resources"])
        assert "nodeSelector" not in spec and "tolerations" not in spec
    # per role: two GPUs a worker, decode's own resources and nodes
    found = workloads(render({"gpu": {"enabled": True, "perWorker": 2, "memoryUtilization": 0.8},
                              "decode": {"resources": {"limits": {"memory": "64Gi"}},
                                         "nodeSelector": {"gpu": "h100"}}}))
    prefill = pod_template(found["prefill-worker"])["spec"]
    decode = pod_template(found["decode-worker"])["spec"]
    assert prefill["containers"][0]["resources"]["limits"] == {"memory": "32Gi",
                                                               "nvidia.com/gpu": 2}
    assert decode["containers"][0]["resources"] == {"limits": {"memory": "64Gi",
                                                               "nvidia.com/gpu": 2}}
    assert decode["nodeSelector"] == {"gpu": "h100", "nvidia.com/gpu.present": "true"}
    assert run_args(decode["containers"][0], monkeypatch).gpu_memory_utilization == 0.8


def test_the_kv_secret_reaches_every_worker(monkeypatch):
    def workers_secret(docs) -> set[str]:
        found = workloads(docs)
        return {run_args(pod_template(found[c])["spec"]["containers"][0], monkeypatch).kv_secret
                for c in WORKER_ROLES}

    docs = render()
    secret = one(docs, "Secret", "-kv")
    assert workers_secret(docs) == {f"<secret {secret['metadata']['name']}/kv-secret>"}
    generated = base64.b64decode(secret["data"]["kv-secret"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", generated)
    secret = one(render({"kvSecret": {"value": "s3cret"}}), "Secret", "-kv")
    assert base64.b64decode(secret["data"]["kv-secret"]) == b"s3cret"
    docs = render({"kvSecret": {"existingSecret": "mine", "key": "k"}})
    assert set(kind(docs, "Secret")) == {f"{RELEASE}-tls"}
    assert workers_secret(docs) == {"<secret mine/k>"}
    gateway = pod_template(workloads(docs)["gateway"])["spec"]["containers"][0]
    assert "PDSERVE_KV_SECRET" not in container_env(gateway)  # workers only


def test_the_chart_makes_the_deployments_certificates_and_each_pod_holds_its_role(tmp_path):
    """tls.enabled (the default): a CA and a certificate per role (Helm's genCA/genSignedCert)
    that pdserve's own TLS code loads; every service gets PDSERVE_TLS_DIR and its role's files."""
    docs = render()
    secret = one(docs, "Secret", "-tls")
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    assert set(data) == {"ca.crt"} | {f"{r}.{e}" for r in ROLES for e in ("crt", "key")}
    ca = x509.load_pem_x509_certificate(data["ca.crt"])
    for role in ROLES:
        cert = x509.load_pem_x509_certificate(data[f"{role}.crt"])
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == role
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert role in sans.get_values_for_type(x509.DNSName)
        directory = tmp_path / role
        directory.mkdir()
        for name in ("ca.crt", f"{role}.crt", f"{role}.key"):
            (directory / name).write_bytes(data[name])
        files = TLSFiles.in_dir(directory, role)
        kv_server_context(files), kv_client_context(files)  # the key and chain load
        grpc_server_credentials(files), grpc_channel_credentials(files)
    roles = {"scheduler": "scheduler", "gateway": "gateway", "prefill-worker": "worker",
             "decode-worker": "worker"}
    for component, workload in workloads(docs).items():
        spec = pod_template(workload)["spec"]
        (container,) = spec["containers"]
        assert container_env(container)["PDSERVE_TLS_DIR"] == TLS_DIR
        (volume,) = [v for v in spec["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        keys = {i["key"] for i in volume["secret"]["items"]}
        assert keys == {"ca.crt", f"{roles[component]}.crt", f"{roles[component]}.key"}
    clear = render({"tls": {"enabled": False}})
    assert f"{RELEASE}-tls" not in kind(clear, "Secret")
    for workload in workloads(clear).values():
        (container,) = pod_template(workload)["spec"]["containers"]
        assert "PDSERVE_TLS_DIR" not in container_env(container)
        assert "--health-port" not in container["args"] or container["args"][0] != "scheduler"


def test_the_dashboard_configmap_is_the_dashboard_file():
    (configmap,) = [d for d in render()
                    if d["kind"] == "ConfigMap" and "pdserve.json" in d.get("data", {})]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["data"]["pdserve.json"] == DASHBOARD.read_text()
    assert json.loads(configmap["data"]["pdserve.json"])["uid"] == "pdserve-overview"
    # one file for compose and the chart: no copy elsewhere
    assert list((ROOT / "compose").rglob("pdserve.json")) == [DASHBOARD]
    assert not [d for d in render({"grafana": {"dashboard": {"enabled": False}}})
                if d["kind"] == "ConfigMap"]


def test_gateway_scales_with_an_autoscaler():
    docs = render()
    gateway = workloads(docs)["gateway"]
    (hpa,) = kind(docs, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": gateway["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)
    assert "replicas" not in gateway["spec"]  # the autoscaler owns the count
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"  # a utilization needs a request to divide by
    assert pod_template(gateway)["spec"]["containers"][0]["resources"]["requests"]["cpu"]
    docs = render({"gateway": {"autoscaling": {"enabled": False}, "replicas": 3}})
    assert kind(docs, "HorizontalPodAutoscaler") == {}
    assert workloads(docs)["gateway"]["spec"]["replicas"] == 3


def test_scheduler_restarts_fast_and_alone():
    scheduler = workloads(render())["scheduler"]
    spec = pod_template(scheduler)["spec"]
    assert scheduler["spec"]["replicas"] == 1
    assert scheduler["spec"]["strategy"] == {"type": "Recreate"}  # never two at once
    assert "initContainers" not in spec  # no model to load
    assert [v["name"] for v in spec["volumes"]] == ["tls"]  # its certificate only
    assert spec["containers"][0]["startupProbe"]["periodSeconds"] <= 2
    assert spec["terminationGracePeriodSeconds"] <= 10


def test_model_sources(monkeypatch):
    found = workloads(render(CASES["existing-model"]))
    for component in ("gateway", *WORKER_ROLES):
        spec = pod_template(found[component])["spec"]
        assert "initContainers" not in spec  # the checkpoint is already there
        (volume,) = [v for v in spec["volumes"] if v["name"] == "models"]
        assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        args = run_args(spec["containers"][0], monkeypatch)
        assert args.model == "/models/Llama-3.1-8B-Instruct"
    gateway = pod_template(found["gateway"])["spec"]["containers"][0]
    assert run_args(gateway, monkeypatch).served_model_name == ["Llama-3.1-8B-Instruct"]
    assert container_env(gateway)["PDSERVE_API_KEY"] == "<secret api/api-key>"
    spec = pod_template(workloads(render(CASES["host-path"]))["decode-worker"])["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "models"]
    assert volume["hostPath"] == {"path": "/data/models", "type": "DirectoryOrCreate"}
    with pytest.raises(helm_python.HelmRenderError, match="model.source tiny"):
        render({"model": {"source": "tiny", "existingClaim": "models"}})
    with pytest.raises(helm_python.HelmRenderError, match="model.path"):
        render({"model": {"source": "existing"}})


def test_tracing_reaches_every_service(monkeypatch):
    endpoint = CASES["existing-model"]["otlp"]["endpoint"]
    for component, workload in workloads(render(CASES["existing-model"])).items():
        container = pod_template(workload)["spec"]["containers"][0]
        assert run_args(container, monkeypatch).otlp_traces_endpoint == endpoint, component
    for workload in workloads(render()).values():
        container = pod_template(workload)["spec"]["containers"][0]
        assert not run_args(container, monkeypatch).otlp_traces_endpoint


def test_service_monitor_scrapes_every_service():
    docs = render({"metrics": {"serviceMonitor": {"enabled": True,
                                                  "labels": {"release": "prom"}}}})
    (monitor,) = kind(docs, "ServiceMonitor").values()
    assert monitor["metadata"]["labels"]["release"] == "prom"
    selector = monitor["spec"]["selector"]["matchLabels"]
    endpoints = {e["port"]: e["path"] for e in monitor["spec"]["endpoints"]}
    for svc in kind(docs, "Service").values():
        assert selector.items() <= svc["metadata"]["labels"].items()
        scraped = [p for p in svc["spec"]["ports"] if p["name"] in endpoints]
        assert len(scraped) == 1, svc["metadata"]["name"]  # its /metrics, once


def test_leader_worker_set_is_one_pod_a_group_until_tensor_parallelism():
    docs = render(CASES["lws"])
    sets = kind(docs, "LeaderWorkerSet")
    assert len(sets) == 2 and not [d for d in kind(docs, "Deployment") if "worker" in d]
    for lws in sets.values():
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 1
    # its controller names a headless Service after each set: the chart's are others
    assert not set(sets) & set(kind(docs, "Service"))
    with pytest.raises(helm_python.HelmRenderError, match="tensor parallelism"):
        render({"leaderWorkerSet": {"enabled": True, "size": 2}})
