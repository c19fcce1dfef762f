"""Mutual TLS (common/tls.py): the certificates `pdserve make-certs` writes, and the scheduler's
gRPC port under TLS: who may call what, and who cannot connect at all."""

from __future__ import annotations

import argparse
import asyncio
import logging
import stat
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from common.health import check
from common.tls import (
    ROLES,
    TLSFiles,
    add_tls_args,
    grpc_channel_credentials,
    is_loopback,
    make_certs,
    scheduler_channel_options,
    tls_from_args,
    warn_if_exposed,
)
from protos import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.scheduler.config import SchedulerConfig
from services.scheduler.server import API_SERVICE, create_server


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    make_certs(directory, hosts=["scheduler.example", "10.1.2.3"], days=30)
    return directory


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("foreign")
    make_certs(directory)
    return directory


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_make_certs_writes_a_ca_and_a_certificate_per_role(certs: Path) -> None:
    ca = load(certs / "ca.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for role in ROLES:
        cert = load(certs / f"{role}.crt")
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == role
        cert.verify_directly_issued_by(ca)  # raises unless the CA signed it
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert set(sans.get_values_for_type(x509.DNSName)) == {role, "localhost",
                                                                 "scheduler.example"}
        assert {str(a) for a in sans.get_values_for_type(x509.IPAddress)} == {
            "127.0.0.1", "::1", "10.1.2.3"}
        assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days == 30
        assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    for key in [certs / "ca.key", *(certs / f"{r}.key" for r in ROLES)]:
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    assert stat.S_IMODE((certs / "ca.crt").stat().st_mode) == 0o644


def test_make_certs_never_overwrites(certs: Path) -> None:
    before = (certs / "ca.crt").read_bytes()
    with pytest.raises(ValueError, match="already holds ca.crt"):
        make_certs(certs)
    assert (certs / "ca.crt").read_bytes() == before


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_tls_args(p, "gateway")
    return p.parse_args(list(argv))


def test_tls_flags(certs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PDSERVE_TLS_DIR", "PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY", "PDSERVE_TLS_CA"):
        monkeypatch.delenv(var, raising=False)
    assert tls_from_args(parse(), "gateway") is None
    assert tls_from_args(parse("--tls-dir", str(certs)), "gateway") == \
        TLSFiles(certs / "gateway.crt", certs / "gateway.key", certs / "ca.crt")
    single = parse("--tls-cert", str(certs / "admin.crt"), "--tls-key", str(certs / "admin.key"),
                   "--tls-ca", str(certs / "ca.crt"), "--tls-dir", str(certs))
    assert tls_from_args(single, "gateway").cert == certs / "admin.crt"  # the single files win
    with pytest.raises(ValueError, match="go together"):
        tls_from_args(parse("--tls-cert", str(certs / "admin.crt")), "gateway")
    with pytest.raises(ValueError, match=r"gateway\.crt.*make-certs"):
        tls_from_args(parse("--tls-dir", str(tmp_path)), "gateway")
    monkeypatch.setenv("PDSERVE_TLS_DIR", str(certs))
    assert tls_from_args(parse(), "gateway").ca == certs / "ca.crt"


def test_binding_beyond_loopback_in_the_clear_warns(certs: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    assert [is_loopback(h) for h in ("127.0.0.1", "127.3.0.1", "::1", "[::1]", "localhost")] \
        == [True] * 5
    assert not any(is_loopback(h) for h in ("0.0.0.0", "", "::", "10.0.0.1", "scheduler"))
    with caplog.at_level(logging.WARNING):
        assert not warn_if_exposed("127.0.0.1", None, "the scheduler", "do anything")
        assert not warn_if_exposed("0.0.0.0", TLSFiles.in_dir(certs, "scheduler"),
                                   "the scheduler", "do anything")
        assert caplog.records == []
        assert warn_if_exposed("0.0.0.0", None, "the scheduler", "attach as a worker")
    assert "the scheduler binds 0.0.0.0 without TLS: anyone who reaches it can attach as a " \
           "worker" in caplog.text and "--tls-dir" in caplog.text


# -- the scheduler's port under mutual TLS ---------------------------------------------------


def channel(address: str, files: TLSFiles | None) -> grpc.aio.Channel:
    if files is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, grpc_channel_credentials(files),
                                   options=scheduler_channel_options(files))


async def code_of(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def attach_code(address: str, files: TLSFiles, write: bool) -> tuple[grpc.StatusCode, str]:
    """Attach: a caller refused by its role gets PERMISSION_DENIED before anything is read (so
    it writes nothing: a write racing the refusal fails on its own); one past the role check
    that writes a first message that does not register gets INVALID_ARGUMENT."""
    async with channel(address, files) as ch:
        call = worker_pb2_grpc.WorkerControlStub(ch).Attach(timeout=10)
        if write:
            await call.write(worker_pb2.WorkerMessage())
        try:
            await call.read()
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""


@pytest.mark.anyio
async def test_the_scheduler_under_tls_answers_each_role_its_methods_only(
        certs: Path, foreign: Path) -> None:
    config = SchedulerConfig(port=0, tls=TLSFiles.in_dir(certs, "scheduler"), health_port=0)
    server, port, service = await create_server(config)
    address = f"127.0.0.1:{port}"
    role = {r: TLSFiles.in_dir(certs, r) for r in ROLES}
    try:
        stats = scheduler_pb2.StatsRequest()
        abort = scheduler_pb2.AbortRequest(request_id="nobody")
        generate = scheduler_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2])
        expected = {  # role -> (Stats, Abort, Generate's and Session's first answer)
            "gateway": (grpc.StatusCode.OK, grpc.StatusCode.OK, None),
            "admin": (grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED,
                      grpc.StatusCode.PERMISSION_DENIED),
            "worker": (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.PERMISSION_DENIED,
                       grpc.StatusCode.PERMISSION_DENIED),
            "scheduler": (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.PERMISSION_DENIED,
                          grpc.StatusCode.PERMISSION_DENIED),
        }
        for name, (want_stats, want_abort, want_generate) in expected.items():
            async with channel(address, role[name]) as ch:
                stub = scheduler_pb2_grpc.SchedulerStub(ch)
                assert await code_of(stub.Stats(stats, timeout=10)) == want_stats, name
                assert await code_of(stub.Abort(abort, timeout=10)) == want_abort, name
                if want_generate is not None:
                    call = stub.Generate(generate, timeout=10)
                    assert await code_of(call.read()) == want_generate, name
                    session = stub.Session(timeout=10)
                    assert await code_of(session.read()) == want_generate, name
        for name in ("gateway", "admin", "scheduler"):
            code, details = await attach_code(address, role[name], write=False)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "worker" in details, name
        code, details = await attach_code(address, role["worker"], write=True)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "register" in details
        # in the clear, or with another deployment's certificate: no connection at all
        for files in (None, TLSFiles.in_dir(foreign, "gateway")):
            async with channel(address, files) as ch:
                call = scheduler_pb2_grpc.SchedulerStub(ch).Stats(stats, timeout=3)
                assert await code_of(call) == grpc.StatusCode.UNAVAILABLE
        assert service.scheduler.num_running == 0 and not service.scheduler.waiting
    finally:
        await server.stop(grace=None)


@pytest.mark.anyio
async def test_a_health_port_in_the_clear_beside_the_tls_port(certs: Path) -> None:
    from common.ports import free_port
    health_port = free_port()
    config = SchedulerConfig(port=0, tls=TLSFiles.in_dir(certs, "scheduler"),
                             health_port=health_port)
    server, port, service = await create_server(config)
    try:
        status = await asyncio.to_thread(check, f"127.0.0.1:{health_port}", API_SERVICE, 5)
        assert status == "SERVING"
        assert await asyncio.to_thread(check, f"127.0.0.1:{health_port}", "", 5) == "NOT_SERVING"
    finally:
        await service.health.stop()
        await server.stop(grace=None)
