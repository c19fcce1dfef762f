"""Mutual TLS between pdserve's services, and who may call what.

A deployment has its own certificate authority (`pdserve make-certs DIR`). Every service holds
a certificate from it whose common name is its role:

    role        holds it                        may call on the scheduler
    scheduler   the scheduler (server side)     -
    gateway     each gateway process            Generate, Abort, Stats, health
    worker      prefill and decode workers      Attach (and send or take KV from a worker)
    admin       `pdserve stats`, `pdserve up`   Stats, health

Identity is the certificate's role, not the address it is reached at: workers are dialled at
addresses no certificate can know in advance (pod IPs), so a client checks that the scheduler's
certificate names "scheduler" (gRPC's target name override) and a KV sender that its receiver's
names "worker"; each side presents its own certificate and the other requires one from the CA.

Files of a TLS directory: ca.crt, and <role>.crt / <role>.key for each role (ca.key stays with
whoever issues certificates). Without TLS everything runs in the clear, meant for loopback; a
service that binds another address in the clear says so in its log (warn_if_exposed).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import logging
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ROLES = ("scheduler", "gateway", "worker", "admin")
SCHEDULER_NAME = "scheduler"  # the name every client checks in the scheduler's certificate
WORKER_NAME = "worker"
CA_FILE, CA_KEY_FILE = "ca.crt", "ca.key"
DEFAULT_DAYS = 365


@dataclass(frozen=True)
class TLSFiles:
    """One service's certificate, its key and the deployment's CA, as PEM files."""

    cert: Path
    key: Path
    ca: Path

    @classmethod
    def in_dir(cls, directory: str | Path, role: str) -> TLSFiles:
        d = Path(directory)
        return cls(d / f"{role}.crt", d / f"{role}.key", d / CA_FILE)

    def check(self) -> None:
        """Raises ValueError naming each file that cannot be read."""
        missing = [str(p) for p in (self.cert, self.key, self.ca) if not os.access(p, os.R_OK)]
        if missing:
            raise ValueError(f"TLS files missing or unreadable: {', '.join(missing)} "
                             "(`pdserve make-certs DIR` writes them)")

    def read(self) -> tuple[bytes, bytes, bytes]:
        return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()


def add_tls_args(p: argparse.ArgumentParser, role: str) -> None:
    env = os.environ.get
    p.add_argument("--tls-dir", default=env("PDSERVE_TLS_DIR", ""),
                   help=f"mutual TLS on every internal channel with the files of this directory "
                        f"(ca.crt, {role}.crt, {role}.key: `pdserve make-certs DIR`); "
                        "empty: in the clear (env PDSERVE_TLS_DIR)")
    p.add_argument("--tls-cert", default=env("PDSERVE_TLS_CERT", ""),
                   help="this service's certificate (PEM), instead of --tls-dir's "
                        "(env PDSERVE_TLS_CERT)")
    p.add_argument("--tls-key", default=env("PDSERVE_TLS_KEY", ""),
                   help="its private key (PEM) (env PDSERVE_TLS_KEY)")
    p.add_argument("--tls-ca", default=env("PDSERVE_TLS_CA", ""),
                   help="the deployment's CA certificate (PEM) (env PDSERVE_TLS_CA)")


def tls_from_args(args: argparse.Namespace, role: str) -> TLSFiles | None:
    """The files --tls-dir or --tls-cert/--tls-key/--tls-ca name (the three together), else None.
    Raises ValueError for a partial set or unreadable files."""
    assert role in ROLES, role
    single = [getattr(args, f"tls_{n}", "") for n in ("cert", "key", "ca")]
    directory = getattr(args, "tls_dir", "")
    if any(single) and not all(single):
        raise ValueError("--tls-cert, --tls-key and --tls-ca go together")
    if all(single):
        files = TLSFiles(*(Path(p) for p in single))
    elif directory:
        files = TLSFiles.in_dir(directory, role)
    else:
        return None
    files.check()
    return files


# -- gRPC -----------------------------------------------------------------------------------


def grpc_server_credentials(tls: TLSFiles):
    """A server that requires a client certificate from the CA."""
    import grpc
    cert, key, ca = tls.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=True)


def grpc_channel_credentials(tls: TLSFiles):
    import grpc
    cert, key, ca = tls.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=cert)


def scheduler_channel_options(tls: TLSFiles | None) -> list[tuple[str, str]]:
    """The name a client checks in the scheduler's certificate, whatever address it dials."""
    return [("grpc.ssl_target_name_override", SCHEDULER_NAME)] if tls else []


def peer_role(context) -> str | None:
    """The role (certificate common name) of a gRPC call's peer; None on a call in the clear."""
    names = (context.auth_context() or {}).get("x509_common_name") or []
    return names[0].decode() if names else None


# -- the tcp KV transport -------------------------------------------------------------------


def kv_server_context(tls: TLSFiles) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(tls.cert, tls.key)
    ctx.load_verify_locations(tls.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def kv_client_context(tls: TLSFiles) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(tls.cert, tls.key)
    ctx.load_verify_locations(tls.ca)
    ctx.check_hostname = False  # identity is the role (common_name_of), not the address
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def common_name_of(peer_cert: dict | None) -> str | None:
    """The common name of a peer certificate as ssl.SSLSocket.getpeercert() gives it."""
    for rdn in (peer_cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


# -- warnings -------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """True for a loopback address or `localhost`; "" and 0.0.0.0 bind every interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # "", or a host name: whatever it resolves to may be reachable
        return False


def warn_if_exposed(host: str, tls: TLSFiles | None, service: str, exposure: str) -> bool:
    """Logs a warning when `service` binds a non-loopback address in the clear; True if so."""
    if tls is not None or is_loopback(host):
        return False
    log.warning("%s binds %s without TLS: anyone who reaches it can %s. Give every service "
                "--tls-dir (`pdserve make-certs DIR` writes the files) or bind 127.0.0.1.",
                service, host or "every interface", exposure)
    return True


# -- make-certs -----------------------------------------------------------------------------


def make_certs(directory: str | Path, hosts: Sequence[str] = (), days: int = DEFAULT_DAYS,
               roles: tuple[str, ...] = ROLES) -> list[Path]:
    """A new CA and a certificate per role in `directory` (created; existing files are not
    overwritten: ValueError). Each certificate: common name its role; subject alternative names
    the role, localhost, 127.0.0.1, ::1 and `hosts` (names or addresses); for server and client
    authentication. Keys are ECDSA P-256, written 0600. Returns the files written."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = Path(directory)
    names = [CA_FILE, CA_KEY_FILE] + [f"{r}.{ext}" for r in roles for ext in ("crt", "key")]
    present = [n for n in names if (d / n).exists()]
    if present:
        raise ValueError(f"{d} already holds {', '.join(present)}: remove them or pick another "
                         "directory")
    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    written: list[Path] = []

    def write(name: str, data: bytes, private: bool) -> None:
        path = d / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        written.append(path)

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM,
                                 serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve"),
                         x509.NameAttribute(NameOID.COMMON_NAME, "pdserve CA")])
    ca_cert = (x509.CertificateBuilder()
               .subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(
                   digital_signature=True, key_cert_sign=True, crl_sign=True,
                   content_commitment=False, key_encipherment=False, data_encipherment=False,
                   key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                              critical=False)
               .sign(ca_key, hashes.SHA256()))
    write(CA_FILE, ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
    write(CA_KEY_FILE, key_pem(ca_key), private=True)

    def alt_name(host: str) -> x509.GeneralName:
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            return x509.DNSName(host)

    for role in roles:
        key = ec.generate_private_key(ec.SECP256R1())
        sans = list(dict.fromkeys([role, "localhost", "127.0.0.1", "::1", *hosts]))
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve"),
                    x509.NameAttribute(NameOID.COMMON_NAME, role)]))
                .issuer_name(ca_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName([alt_name(h) for h in sans]),
                               critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                    ca_key.public_key()), critical=False)
                .sign(ca_key, hashes.SHA256()))
        write(f"{role}.crt", cert.public_bytes(serialization.Encoding.PEM), private=False)
        write(f"{role}.key", key_pem(key), private=True)
    return written
