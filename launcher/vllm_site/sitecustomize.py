"""Fixes for vLLM's CPU build with NIXL on a small machine, loaded by every Python process of a vLLM instance
that pdserve starts (this folder is put first on its PYTHONPATH; engine-core processes inherit it).

Runs inside the vLLM venv: it imports nothing of pdserve. Each fix is off unless its variable is set.
  - PDSERVE_NIXL_PTHR_DELAY_US: NIXL's Python API creates its agent with `pthrDelay = 0`, so its progress thread
    spins a core per instance; with this many microseconds between polls it sleeps instead.
  - PDSERVE_VLLM_KEEP_AFFINITY=1: vLLM's NIXL worker calls os.sched_setaffinity to reserve the last core of each
    NUMA node for KV transfers, pinning every instance on the machine to that same core; the call is skipped
    (the OMP threads are placed by VLLM_CPU_OMP_THREADS_BIND instead).
"""

import os


def _patch_nixl_delay(delay_us: int) -> None:
    import importlib.abc
    import importlib.machinery
    import sys

    targets = {"nixl_cu12._api", "nixl_cu13._api", "nixl._api"}

    def patch(module) -> None:
        binding = module.nixlBind
        real_agent = binding.nixlAgent

        class _Binding:
            def __getattr__(self, name):
                return getattr(binding, name)

            @staticmethod
            def nixlAgent(name, config):  # noqa: N802 - the binding's own name
                config.pthrDelay = delay_us
                return real_agent(name, config)

        module.nixlBind = _Binding()

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname not in targets:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return None
            loader = spec.loader
            run = loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())


def _keep_affinity() -> None:
    import sys

    real = os.sched_setaffinity

    def sched_setaffinity(pid, cores):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if "nixl" in caller:
            return None
        return real(pid, cores)

    os.sched_setaffinity = sched_setaffinity


if os.environ.get("PDSERVE_NIXL_PTHR_DELAY_US"):
    _patch_nixl_delay(int(os.environ["PDSERVE_NIXL_PTHR_DELAY_US"]))
if os.environ.get("PDSERVE_VLLM_KEEP_AFFINITY") == "1":
    _keep_affinity()
