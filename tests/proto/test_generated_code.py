"""The committed proto/worker_pb2*.py and proto/ext_proc_pb2*.py match what their .proto files generate now."""

from __future__ import annotations

import pytest

import subprocess
import sys

from tests.helpers import REPO

pytestmark = pytest.mark.system


@pytest.mark.parametrize("proto,outputs", [
    ("worker", ("worker_pb2.py", "worker_pb2_grpc.py", "worker_pb2.pyi")),
    ("ext_proc", ("ext_proc_pb2.py", "ext_proc_pb2.pyi")),  # its service is registered by name: no _grpc module
])
def test_generated_grpc_code_is_up_to_date(tmp_path, proto, outputs):
    (tmp_path / "proto").mkdir()
    (tmp_path / "proto" / f"{proto}.proto").write_bytes((REPO / "proto" / f"{proto}.proto").read_bytes())
    grpc_out = ["--grpc_python_out=."] if len(outputs) == 3 else []
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", *grpc_out, "--pyi_out=.",
         f"proto/{proto}.proto"],
        cwd=tmp_path, check=True,
    )
    for name in outputs:
        fresh = (tmp_path / "proto" / name).read_text()
        committed = (REPO / "proto" / name).read_text()
        assert fresh == committed, f"proto/{name} is stale: run `make proto` and commit the result"
