"""The committed proto/worker_pb2*.py match what proto/worker.proto generates now."""

from __future__ import annotations

import pytest

import subprocess
import sys

from tests.helpers import REPO

pytestmark = pytest.mark.system


def test_generated_grpc_code_is_up_to_date(tmp_path):
    (tmp_path / "proto").mkdir()
    (tmp_path / "proto" / "worker.proto").write_bytes((REPO / "proto" / "worker.proto").read_bytes())
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--grpc_python_out=.", "--pyi_out=.",
         "proto/worker.proto"],
        cwd=tmp_path, check=True,
    )
    for name in ("worker_pb2.py", "worker_pb2_grpc.py", "worker_pb2.pyi"):
        fresh = (tmp_path / "proto" / name).read_text()
        committed = (REPO / "proto" / name).read_text()
        assert fresh == committed, f"proto/{name} is stale: run `make proto` and commit the result"
