"""The policy suite drives the scheduler with no model, no protobuf and no network. Its claim is
checked first, in a fresh interpreter where importing torch, grpc or protobuf raises: the
scheduler and this suite's harness must import there (the rest of the test session may have
loaded torch already, so the check cannot be made in this process)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("torch", "grpc", "google.protobuf", "protos")
CHECK = f"""
import importlib.abc, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in {BLOCKED!r}):
            raise ImportError(f"the scheduling policy imported {{name}}")
sys.meta_path.insert(0, Blocked())
import services.scheduler.scheduler, tests.policy.harness
"""


@pytest.fixture(scope="session", autouse=True)
def policy_imports_no_torch_grpc_or_protobuf():
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
