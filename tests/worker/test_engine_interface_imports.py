"""The engine interface is torch-free: the simulated worker (and the coordinator's tools) import it without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.system  # a fresh interpreter: this one has imported torch long ago


def test_importing_the_engine_interface_and_the_simulated_backend_loads_no_torch():
    code = ("import sys, importlib, pkgutil, worker.engine as e\n"
            "for m in pkgutil.iter_modules(e.__path__): importlib.import_module(f'worker.engine.{m.name}')\n"
            "import worker.simulated.build\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
