"""`pdserve up --tls-dir DIR`: mutual TLS on every internal channel (gRPC to the scheduler, the
tcp KV transport between the workers), the certificates written by the launcher. Greedy tokens
equal HuggingFace's with the KV moved over TLS; the scheduler's port refuses whoever holds no
certificate of the deployment."""
import ssl
import subprocess
import time

import httpx
import pytest
import torch
import transformers

from common.ports import free_port
from tests.e2e.conftest import PDSERVE, ROOT, Stack, stop_all
from tests.e2e.test_kv_faults import _generate
from tests.e2e.test_serve import _greedy, _prompt


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def secure(tiny_llama, tmp_path_factory):
    certs = tmp_path_factory.mktemp("tls") / "certs"  # absent: `pdserve up` writes it
    tcp = "--kv-transports tcp"
    stack = Stack(tiny_llama, tmp_path_factory.mktemp("secure"), "--tls-dir", str(certs),
                  "--num-kv-blocks", "64", "--prefill-worker-args", tcp,
                  "--decode-worker-args", tcp,  # every prompt through the prefill worker:
                  "--scheduler-args=--prefill-bypass-threshold 0 --no-saturated-prefill-bypass "
                  "--no-shared-cores-prefill-bypass")
    yield stack, certs
    stack.stop()


def test_greedy_tokens_over_tls_equal_hf_and_the_kv_crossed_tcp(secure, hf):
    stack, certs = secure
    for seed, n in ((1, 40), (2, 9)):
        prompt = _prompt(n, seed)
        assert _generate(stack, prompt) == _greedy(hf, prompt, 8)
    log = stack.log.read_text()
    assert f"certificates for mutual TLS written to {certs}" in log
    assert "(mutual TLS)" in log and "without TLS" not in log
    workers = stack.wait_idle()["workers"]
    sent = {w["role"]: w["kv_blocks_sent"] for w in workers}
    assert sent["prefill"] > 0
    assert all(w["kv_frames_rejected"] == 0 for w in workers)
    assert all(w["num_free_blocks"] == w["num_blocks"] for w in workers)


def test_the_scheduler_refuses_clients_without_the_deployments_certificate(secure, tmp_path):
    stack, certs = secure

    def stats(*tls: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(PDSERVE), "stats", "--scheduler",
                               f"127.0.0.1:{stack.sched_port}", "--timeout", "5", *tls],
                              capture_output=True, text=True, timeout=60)

    clear = stats()
    assert clear.returncode == 1 and "UNAVAILABLE" in clear.stderr
    as_worker = stats("--tls-cert", str(certs / "worker.crt"), "--tls-key",
                      str(certs / "worker.key"), "--tls-ca", str(certs / "ca.crt"))
    assert as_worker.returncode == 1 and "PERMISSION_DENIED" in as_worker.stderr
    ok = stats("--tls-dir", str(certs))
    assert ok.returncode == 0 and '"workers"' in ok.stdout
    made = subprocess.run([str(PDSERVE), "make-certs", str(tmp_path / "other")],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    foreign = stats("--tls-dir", str(tmp_path / "other"))
    assert foreign.returncode == 1 and "UNAVAILABLE" in foreign.stderr


def test_a_gateway_serves_https_beside_it(secure, hf, tiny_llama, tmp_path):
    """Another gateway process on the same TLS scheduler, its API on HTTPS (--ssl-certfile,
    the gateway certificate, which names 127.0.0.1): the client checks it against the CA."""
    stack, certs = secure
    port = free_port()
    log = tmp_path / "gateway.log"
    proc = subprocess.Popen(
        [str(PDSERVE), "gateway", "--model", str(tiny_llama), "--port", str(port),
         "--scheduler", f"127.0.0.1:{stack.sched_port}", "--tls-dir", str(certs),
         "--ssl-certfile", str(certs / "gateway.crt"), "--ssl-keyfile", str(certs / "gateway.key")],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        url = f"https://127.0.0.1:{port}"
        trust = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        with httpx.Client(base_url=url, verify=trust, timeout=120) as c:
            start = time.monotonic()
            while True:
                try:
                    if c.get("/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() - start < 60, log.read_text()[-3000:]
                time.sleep(0.3)
            prompt = _prompt(20, 5)
            name = c.get("/v1/models").json()["data"][0]["id"]
            r = c.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 8,
                                                "temperature": 0, "ignore_eos": True,
                                                "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == _greedy(hf, prompt, 8)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
            httpx.get(f"{url}/health", timeout=10)
    finally:
        stop_all([proc])
