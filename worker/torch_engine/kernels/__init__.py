"""The engine's own CPU kernels, compiled once per machine with its C++ compiler and loaded as torch custom ops.

`paged_attention.cpp` attends over the block pool in place (see its header). It is built at install time
(`python -m worker.torch_engine.kernels`, run by `make install`) into the cache folder, named by a hash of its source, torch's version,
the compiler and the flags, so a changed source or a new torch builds a new library; a worker that finds none
builds it at start-up (one compiler run, tens of seconds) and logs so.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")
# -march=native: built where it runs (a worker image is built on the machine type it runs on; override to move it).
MARCH = os.environ.get("PDSERVE_KERNEL_MARCH", "native")
FLAGS = ("-O3", f"-march={MARCH}", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-w")


class KernelUnavailable(RuntimeError):
    """The kernels cannot be built here (no compiler, or it failed); the message says why."""


def cache_dir() -> Path:
    """PDSERVE_CACHE overrides ~/.cache/pdserve, as for the embedded models."""
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "kernels"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise KernelUnavailable("no C++ compiler found (install g++, or set CXX)")
    return cxx


def library_path() -> Path:
    """Where the library for this source, torch and compiler lives (built or not)."""
    # The compiler by its resolved file and that file's size and time (no process started to ask its version).
    cxx = os.path.realpath(shutil.which(_compiler()) or _compiler())
    stat = os.stat(cxx) if os.path.exists(cxx) else None
    compiler = f"{cxx}:{stat.st_size}:{stat.st_mtime_ns}" if stat else cxx
    # torch's version from its metadata: finding a built library does not import torch (the test runner's
    # start-up checks it).
    torch_version = importlib.metadata.version("torch")
    key = hashlib.sha256(SOURCE.read_bytes() + torch_version.encode() + compiler.encode()
                         + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_dir() / f"pdserve_kernels-{key}.so"


def build(path: Path | None = None) -> Path:
    """Compile the kernels unless already built; returns the library's path."""
    path = path or library_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    import torch
    from torch.utils.cpp_extension import include_paths  # imports setuptools: only when building

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several workers starting at once build it once
        if path.exists():
            return path
        logger.info("building the paged-attention kernel (once per machine; tens of seconds)")
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        cmd = [_compiler(), *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *[f"-I{p}" for p in include_paths()],
               str(SOURCE), "-o", str(tmp), f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise KernelUnavailable(f"compiling {SOURCE.name} failed: {done.stderr.strip()[-2000:]}")
        tmp.replace(path)  # builds of other sources stay: another checkout may be using them
    return path


_loaded = False


def load() -> None:
    """Make `torch.ops.pdserve.*` available (building the library first if needed)."""
    global _loaded
    if not _loaded:
        import torch

        torch.ops.load_library(str(build()))
        _loaded = True


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = build()
    except KernelUnavailable as exc:
        print(f"pdserve kernels not built: {exc}", file=sys.stderr)
        return 1
    print(f"pdserve kernels: {path}")
    return 0
