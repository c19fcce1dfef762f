"""The Grafana dashboard (compose/helm/dashboards/pdserve.json) queries only what pdserve
exports: every metric name and label in its PromQL is checked against the metrics the gateway,
scheduler and worker telemetry register, read from those classes' own registries; and every
metric they export has a panel."""
from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.kv_layout import KVLayout
from common.plans import KVSend, Registration, WorkerCounters
from common.worker.core_board import CoreBoard
from common.worker.telemetry import WorkerTelemetry
from services.gateway.telemetry import GatewayMetrics
from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from services.scheduler.telemetry import SchedulerTelemetry

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "compose" / "helm" / "dashboards" / "pdserve.json"
TARGET_LABELS = {"job", "instance"}           # what Prometheus adds to every scraped series
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__range_s", "__interval_ms"}
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}

AGGREGATIONS = {"sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk",
                "quantile", "count_values", "group", "limitk", "limit_ratio"}
FUNCTIONS = AGGREGATIONS | {
    "abs", "absent", "absent_over_time", "avg_over_time", "ceil", "changes", "clamp",
    "clamp_max", "clamp_min", "count_over_time", "day_of_month", "day_of_week", "delta",
    "deriv", "exp", "floor", "histogram_quantile", "histogram_count", "histogram_sum",
    "histogram_fraction", "idelta", "increase", "irate", "label_join", "label_replace", "ln",
    "log2", "log10", "last_over_time", "max_over_time", "min_over_time", "predict_linear",
    "present_over_time", "quantile_over_time", "rate", "resets", "round", "scalar", "sgn",
    "sort", "sort_desc", "sqrt", "stddev_over_time", "stdvar_over_time", "sum_over_time",
    "time", "timestamp", "vector"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = GROUPING | {"bool", "offset", "and", "or", "unless", "atan2", "inf", "nan"}

TOKEN = re.compile(r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<number>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^=<>(){},])
  | (?P<space>\s+)""", re.X)
VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


# ---- what pdserve exports ------------------------------------------------------------------

def exported_metrics() -> dict[str, tuple[str, set[str] | None]]:
    """Series name (as scraped: `_total`, `_bucket`, ...) -> (its family, its label names; None
    where the family had no sample to read them from), over every service's registry."""
    sched = Scheduler(SchedulerConfig())
    sched.add_worker(Registration(
        worker_id="d0", role="decode", model_fingerprint="m", num_blocks=8,
        layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4,
                        dtype="float32"),
        transports=("shm",), kv_endpoints={"shm": "x"}))
    worker = SimpleNamespace(cache=SimpleNamespace(layout=SimpleNamespace(block_bytes=64)),
                             counters=WorkerCounters(), on_send=None, requests={},
                             runner=SimpleNamespace(num_speculative_tokens=2),  # speculates
                             yielded=0, taken=0, starved_s=0.0)
    with tempfile.TemporaryDirectory() as board_dir:  # a CPU worker sharing its cores
        worker.board = CoreBoard("p0", [0], "g", shm_dir=Path(board_dir))
    worker_telemetry = WorkerTelemetry(worker, "p0", "prefill")
    send = KVSend("t", "r", (0,), (1,), "peer", "tcp")
    worker_telemetry.on_send(send, 0.0, 0.1, "")       # a labelled child of each KV metric
    worker_telemetry.on_send(send, 0.0, 0.1, "refused")
    registries = [GatewayMetrics("m").registry, SchedulerTelemetry(sched).registry,
                  worker_telemetry.registry]
    out: dict[str, tuple[str, set[str] | None]] = {}
    for registry in registries:
        for family in registry.collect():
            if not family.samples:  # labelled and never used: its series names by type
                for suffix in SUFFIXES.get(family.type, ("",)):
                    out[family.name + suffix] = (family.name, None)
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue  # prometheus_client's creation timestamps: nothing to chart
                labels = out.get(s.name, (family.name, set()))[1] or set()
                out[s.name] = (family.name, labels | set(s.labels) - {"le"} |
                               ({"le"} if s.name.endswith("_bucket") else set()))
    return out


# ---- what the dashboard queries ------------------------------------------------------------

@dataclass
class Query:
    selectors: list[tuple[str, set[str]]] = field(default_factory=list)  # metric, matched labels
    grouping: set[str] = field(default_factory=set)                      # by (...), on (...)
    variables: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)


def parse_promql(expr: str) -> Query:
    """The metric selectors, grouping labels and Grafana variables of a PromQL expression: a
    small lexer, enough for the dashboard's queries, that refuses what it does not know."""
    q = Query(variables={a or b for a, b in VARIABLE.findall(expr)})
    text = VARIABLE.sub("1", expr)
    tokens, pos = [], 0
    while pos < len(text):
        m = TOKEN.match(text, pos)
        if m is None:
            q.errors.append(f"cannot read {text[pos:pos + 20]!r}")
            return q
        if m.lastgroup != "space":
            tokens.append((m.lastgroup, m.group()))
        pos = m.end()

    def group_labels(i: int) -> tuple[set[str], int]:
        """Identifiers of the parenthesized list at tokens[i]; the index after it."""
        labels = set()
        assert tokens[i][1] == "("
        i += 1
        while i < len(tokens) and tokens[i][1] != ")":
            if tokens[i][0] == "ident":
                labels.add(tokens[i][1])
            i += 1
        return labels, i + 1

    i = 0
    while i < len(tokens):
        kind, value = tokens[i]
        after = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind != "ident":
            if value == "{":
                q.errors.append("a selector without a metric name")
            i += 1
        elif value in GROUPING:
            if after == "(":
                labels, i = group_labels(i + 1)
                q.grouping |= labels
            else:
                i += 1
        elif value in AGGREGATIONS or value in KEYWORDS:
            i += 1
        elif after == "(":
            if value not in FUNCTIONS:
                q.errors.append(f"unknown function {value}")
            i += 1
        else:  # a metric name, perhaps with label matchers
            labels = set()
            i += 1
            if after == "{":
                i += 1
                while i < len(tokens) and tokens[i][1] != "}":
                    if tokens[i][0] == "ident":
                        labels.add(tokens[i][1])
                    i += 1
                i += 1
            q.selectors.append((value, labels))
    return q


def check_query(expr: str, metrics: dict[str, tuple[str, set[str] | None]]) -> list[str]:
    """What is wrong with one PromQL expression against the exported metrics."""
    q = parse_promql(expr)
    problems = list(q.errors)
    if not q.selectors:
        problems.append("queries no metric")
    known_labels = set(TARGET_LABELS)
    for name, labels in q.selectors:
        if name not in metrics:
            family = next((f for f, _ in metrics.values() if f == name), None)
            hint = f" (a {family} series is named with a suffix)" if family else ""
            problems.append(f"{name} is not exported{hint}")
            continue
        exported = metrics[name][1]
        if exported is None:
            continue
        known_labels |= exported
        unknown = labels - exported - TARGET_LABELS
        if unknown:
            problems.append(f"{name} has no label {sorted(unknown)}; it has {sorted(exported)}")
    if all(metrics.get(name, ("", set()))[1] is not None for name, _ in q.selectors):
        unknown = q.grouping - known_labels
        if unknown:
            problems.append(f"grouping by {sorted(unknown)}, which no queried metric has")
    return [f"{expr}: {p}" for p in problems]


def label_values_query(query: str) -> tuple[str, str]:
    """label_values(SELECTOR, LABEL) -> (SELECTOR, LABEL)."""
    m = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\s*\)\s*", query)
    assert m, f"not a label_values(selector, label) query: {query}"
    return m.group(1), m.group(2)


# ---- the tests -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def metrics():
    return exported_metrics()


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row holds its panels
    return out


def expressions(dashboard: dict) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]


def test_the_catalog_reads_every_service(metrics):
    for name in ("pdserve:time_to_first_token_seconds_bucket", "pdserve:prompt_tokens_total",
                 "pdserve:request_queue_time_seconds_count", "pdserve:kv_cache_usage_perc",
                 "pdserve:kv_transfer_seconds_bucket", "pdserve:worker_steps_total"):
        assert name in metrics
    assert metrics["pdserve:kv_cache_usage_perc"][1] == {"worker_id", "role"}
    assert metrics["pdserve:kv_transfer_bytes_total"][1] == {"transport"}
    assert all(name.startswith("pdserve:") for name in metrics)


def test_every_query_uses_exported_metrics_and_labels(dashboard, metrics):
    exprs = expressions(dashboard)
    assert len(exprs) > 20
    problems = [p for e in exprs for p in check_query(e, metrics)]
    assert not problems, "\n".join(problems)


def test_the_check_fails_on_what_is_not_exported(metrics):
    """The check above can fail: names vLLM has and pdserve does not, a counter without its
    _total, labels no metric carries, and functions PromQL lacks."""
    good = 'sum by (role) (rate(pdserve:worker_steps_total{worker_id=~"$worker"}[5m]))'
    assert check_query(good, metrics) == []
    for bad, reason in [
        ("rate(pdserve:no_such_thing_total[5m])", "not exported"),
        ("rate(vllm:prompt_tokens_total[5m])", "not exported"),
        ("rate(pdserve:prompt_tokens[5m])", "named with a suffix"),
        ('pdserve:kv_cache_usage_perc{worker="d0"}', "no label"),
        ("sum by (worker) (pdserve:kv_cache_usage_perc)", "grouping by"),
        ("sum(ratee(pdserve:prompt_tokens_total[5m]))", "unknown function"),
        ('{__name__="pdserve:prompt_tokens_total"}', "without a metric name"),
        ("1 + 1", "queries no metric"),
    ]:
        problems = check_query(bad, metrics)
        assert any(reason in p for p in problems), (bad, problems)


def test_every_exported_metric_has_a_panel(dashboard, metrics):
    queried = {name for e in expressions(dashboard) for name, _ in parse_promql(e).selectors}
    families = {family for family, _ in metrics.values()}
    charted = {metrics[name][0] for name in queried if name in metrics}
    assert families - charted == set(), "metrics without a panel: add one to the dashboard"


def test_variables_are_defined_and_query_exported_labels(dashboard, metrics):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name, v in variables.items():
        if v["type"] != "query":
            continue
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        selector, label = label_values_query(query)
        assert check_query(selector, metrics) == []
        (metric, _), = parse_promql(selector).selectors
        assert label in metrics[metric][1], (name, label)
        used = set().union(*(parse_promql(e).variables for e in expressions(dashboard)))
        assert name in used, f"variable {name} filters nothing"
    for e in expressions(dashboard):
        undefined = parse_promql(e).variables - set(variables) - GRAFANA_BUILTINS
        assert not undefined, (e, undefined)


def test_panels_are_well_formed(dashboard):
    assert dashboard["uid"] == "pdserve-overview" and dashboard["title"] == "pdserve"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for p in panels(dashboard):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
    titles = {p["title"] for p in panels(dashboard)}
    for expected in ("Time to first token", "Inter-token latency", "End-to-end request latency",
                     "Queue time", "KV cache usage per worker", "KV transfer latency",
                     "Token throughput", "Scheduler state"):
        assert expected in titles
