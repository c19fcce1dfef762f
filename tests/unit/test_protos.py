"""The committed generated code is what `make protos` would write now."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ["protos/scheduler.proto", "protos/worker.proto", "protos/kv_transfer.proto"]


def test_generated_code_is_fresh(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *PROTOS],
                   cwd=ROOT, check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert len(generated) == 3 * len(PROTOS)
    stale = [str(p) for p in generated if (ROOT / p).read_bytes() != (tmp_path / p).read_bytes()]
    assert not stale, f"run `make protos`: stale {stale}"
