"""Gateway configuration: one frozen dataclass, completed and validated at construction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from common.models.gguf import find_gguf, gguf_info
from common.tls import TLSFiles
from services.gateway.sampling_defaults import SamplingDefaults, load_sampling_defaults
from services.gateway.structured_outputs import StructuredOutputsConfig
from services.gateway.tools import PARSERS


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway process needs; CLI flags map 1:1 to fields.

    Invariants after construction: `served_model_name` is a non-empty tuple (default: `model` as
    given, like vLLM), `max_model_len` is set (default: config.json max_position_embeddings),
    an empty `api_key` means no authentication, and `sampling_defaults` holds what
    `generation_config` names (auto: the model's generation_config.json; vllm: none; or a
    directory holding one).
    """

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    scheduler: str = "127.0.0.1:50051"
    served_model_name: tuple[str, ...] = ()
    max_model_len: int | None = None
    api_key: str | None = None
    generation_config: str = "auto"
    request_timeout_s: float = 600.0  # deadline of every scheduler call
    connect_timeout_s: float = 5.0  # how long startup waits for the scheduler channel
    no_worker_wait_s: float = 5.0  # how long a request waits for a worker path before its 503
    scheduler_recovery_s: float = 30.0  # a lost scheduler's streams wait this long for another
    drain_timeout_s: float = 30.0  # SIGTERM: how long open streams may run on before they end
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    enable_auto_tool_choice: bool = False  # tool_choice "auto": the model's calls are parsed
    tool_call_parser: str | None = None  # how: hermes or llama3_json (tools.py)
    max_request_body_bytes: int = 16 << 20  # larger bodies get 413 (body_guard.py)
    request_body_timeout_s: float = 30.0  # a body not in by then gets 408 (body_guard.py)
    stream_write_timeout_s: float = 30.0  # a response whose reader takes nothing this long ends
    max_concurrent_requests_per_key: int = 0  # in flight per API key (limits.py); 0: no limit
    tls: TLSFiles | None = None  # mutual TLS to the scheduler (common/tls.py)
    ssl_keyfile: str | None = None  # HTTPS on the API (with ssl_certfile)
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None  # clients' certificates are checked against these
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED of clients
    sampling_defaults: SamplingDefaults = field(init=False, default=SamplingDefaults())

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("a model directory is required (--model or PDSERVE_MODEL)")
        model_dir = Path(self.model)
        if not model_dir.exists():
            raise ValueError(f"model {self.model!r} does not exist")
        if not model_dir.is_dir() and find_gguf(model_dir) is None:
            raise ValueError(f"model {self.model!r} is neither a directory nor a .gguf file")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.host:
            raise ValueError("host must not be empty")
        if not self.scheduler:
            raise ValueError("scheduler address must not be empty")
        if self.request_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("request and connect timeouts must be positive")
        if self.stream_write_timeout_s <= 0:
            raise ValueError("--stream-write-timeout must be positive")
        if self.request_body_timeout_s <= 0:
            raise ValueError("--request-body-timeout must be positive")
        if self.max_concurrent_requests_per_key < 0:
            raise ValueError("--max-concurrent-requests-per-key must be >= 0")
        if self.max_request_body_bytes < 1:
            raise ValueError("--max-request-body-mib must be positive")
        if self.no_worker_wait_s < 0:
            raise ValueError("--no-worker-wait must be >= 0")
        if self.drain_timeout_s < 0:
            raise ValueError("--drain-timeout must be >= 0")
        if self.scheduler_recovery_s < 0:
            raise ValueError("--scheduler-recovery-timeout must be >= 0")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r}: choose from "
                             f"{', '.join(PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile),
                           ("--ssl-certfile", self.ssl_certfile),
                           ("--ssl-ca-certs", self.ssl_ca_certs)):
            if path and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError("--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required)")
        if self.ssl_cert_reqs and not self.ssl_ca_certs:
            raise ValueError("--ssl-cert-reqs needs --ssl-ca-certs")
        self._set_served_model_name()
        self._set_max_model_len(model_dir)
        if not self.api_key:
            object.__setattr__(self, "api_key", None)
        object.__setattr__(
            self, "sampling_defaults", load_sampling_defaults(self.generation_config, self.model)
        )

    def _set_served_model_name(self) -> None:
        names = tuple(self.served_model_name) or (self.model,)
        if any(not name for name in names):
            raise ValueError("served model names must not be empty")
        object.__setattr__(self, "served_model_name", names)

    def _set_max_model_len(self, model_dir: Path) -> None:
        model_limit = read_max_position_embeddings(model_dir)
        max_len = self.max_model_len if self.max_model_len is not None else model_limit
        if max_len is None:
            raise ValueError(
                f"{model_dir}/config.json has no max_position_embeddings; pass --max-model-len"
            )
        if max_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_len}")
        if model_limit is not None and max_len > model_limit:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's "
                f"max_position_embeddings {model_limit}"
            )
        object.__setattr__(self, "max_model_len", max_len)


def read_max_position_embeddings(model_dir: Path) -> int | None:
    """config.json's max_position_embeddings (also under text_config), a GGUF's context
    length, or None when absent."""
    gguf_file = find_gguf(model_dir)
    if gguf_file is not None:
        return gguf_info(gguf_file).context_length
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None
