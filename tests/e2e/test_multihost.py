"""The four services on four "hosts": network namespaces this test creates, joined by veth pairs
to a bridge in a fifth. KV crosses hosts over tcp; the greedy output equals the single-host run
(and HuggingFace's). Every connection is made from inside a namespace the test created."""
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import transformers

from tests.e2e.conftest import stop_all
from tests.e2e.test_serve import _greedy, _prompt

PDSERVE = str(Path(sys.executable).parent / "pdserve")
ROLES = ["scheduler", "prefill", "decode", "gateway"]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2 to create network namespaces")


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


class Hosts:
    """Namespaces <tag>-sw (a bridge) and one per role, each with one veth on 10.<net>.0.0/24."""

    def __init__(self):
        self.tag = f"pds{uuid.uuid4().hex[:6]}"
        self.net = f"10.{200 + os.getpid() % 50}.{int(self.tag[3:5], 16)}"
        self.names = {role: f"{self.tag}-{i}" for i, role in enumerate(ROLES)}
        self.addr = {role: f"{self.net}.{i + 1}" for i, role in enumerate(ROLES)}
        self.switch = f"{self.tag}-sw"
        self.created: list[str] = []
        try:
            self._build()
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            self.close()
            pytest.skip(f"cannot build network namespaces here: {e}")

    def _build(self):
        for ns in [self.switch, *self.names.values()]:
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, role in enumerate(ROLES):
            ns, host_if, sw_if = self.names[role], f"{self.tag}h{i}", f"{self.tag}s{i}"
            sh("ip", "link", "add", host_if, "netns", ns, "type", "veth",
               "peer", "name", sw_if, "netns", self.switch)
            sh("ip", "-n", self.switch, "link", "set", sw_if, "master", "br0")
            sh("ip", "-n", self.switch, "link", "set", sw_if, "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.addr[role]}/24", "dev", host_if)
            sh("ip", "-n", ns, "link", "set", host_if, "up")

    def popen(self, role: str, args: list[str], log: Path) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.names[role], *args],
                                stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def run(self, role: str, args: list[str], timeout: float = 120) -> str:
        out = subprocess.run(["ip", "netns", "exec", self.names[role], *args],
                             capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    def close(self):
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.created.clear()


CLIENT = """
import json, sys, time, httpx
url, prompts = sys.argv[1], json.loads(sys.argv[2])
deadline = time.monotonic() + 180
while True:
    try:
        if httpx.get(url + "/ready", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if time.monotonic() > deadline:
        sys.exit("gateway not ready")
    time.sleep(0.5)
name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
out = []
for p in prompts:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": name, "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    r.raise_for_status()
    out.append(r.json()["choices"][0]["token_ids"])
print(json.dumps(out))
"""


def test_services_on_four_hosts_match_the_single_host_run(tiny_llama, tmp_path):
    hosts = Hosts()
    procs = []
    try:
        a = hosts.addr
        sched = f"{a['scheduler']}:50051"
        worker = ["--model", str(tiny_llama), "--scheduler", sched, "--cpu-threads", "1",
                  "--dtype", "float32",
                  "--num-kv-blocks", "128", "--kv-transports", "shm", "tcp"]
        cmds = {
            "scheduler": [PDSERVE, "scheduler", "--host", a["scheduler"], "--port", "50051"],
            "prefill": [PDSERVE, "prefill-worker", *worker, "--kv-host", a["prefill"],
                        "--host-id", "host-prefill"],
            "decode": [PDSERVE, "decode-worker", *worker, "--kv-host", a["decode"],
                       "--host-id", "host-decode"],
            "gateway": [PDSERVE, "gateway", "--host", a["gateway"], "--port", "8000",
                        "--scheduler", sched, "--model", str(tiny_llama)],
        }
        for role, cmd in cmds.items():
            procs.append(hosts.popen(role, cmd, tmp_path / f"{role}.log"))
            if role == "scheduler":
                time.sleep(1.0)
        prompts = [_prompt(n, 500 + n) for n in (1, 17, 70)]
        # wait for both workers to register, asking from the scheduler's own host
        deadline = time.monotonic() + 180
        while True:
            stats = json.loads(hosts.run("scheduler", [PDSERVE, "stats", "--scheduler", sched]))
            if len(stats["workers"]) == 2:
                break
            assert time.monotonic() < deadline, (tmp_path / "prefill.log").read_text()[-2000:]
            time.sleep(0.5)
        got = json.loads(hosts.run("gateway", [sys.executable, "-c", CLIENT,
                                               f"http://{a['gateway']}:8000", json.dumps(prompts)]))
        hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        for p, tokens in zip(prompts, got):
            assert tokens == _greedy(hf.eval(), p, 12)
        stats = json.loads(hosts.run("scheduler", [PDSERVE, "stats", "--scheduler", sched]))
        by_role = {w["role"]: w for w in stats["workers"]}
        assert by_role["decode"]["kv_endpoint"].startswith("shm://")  # its preferred one...
        assert by_role["decode"]["kv_blocks_received"] > 0  # ...yet KV crossed hosts over tcp
        assert by_role["prefill"]["prompt_tokens_computed"] == 1 + 17 + 70
        assert all(w["num_free_blocks"] == w["num_blocks"] for w in stats["workers"])
    finally:
        stop_all(procs)
        hosts.close()
