"""`pdserve up`: a coordinator and K prefill + K decode workers as processes on 127.0.0.1, supervised.

Each child is its own OS process whose command line names its role, started with a parent death signal so
none outlives this launcher. A child that exits once the cluster is up is restarted with backoff on the same
address (launcher/supervisor.py): a worker on the gRPC port it first bound (the coordinator's instance list
stays valid; it routes around the worker meanwhile), the coordinator on the same predict and management ports
(pinned in its config file after its first start). `pdserve up` exits 0 on SIGTERM/SIGINT after stopping every
child, and 1 when something cannot start: at once on the first start, or after `max_start_failures` failed
restarts in a row. With `--autoscale` the coordinator starts first, the workers register with it, and
launcher/autoscaler.py starts, stops and switches them to the online planner's counts. SIGUSR2 restarts every
child, one at a time, through its drain (launcher/rolling_restart.py).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from launcher.cluster_security import ClusterSecurity
from launcher.gateway_cluster import ENDPOINT_PICKER, start_envoy, start_sidecars, wait_announced
from launcher.management_poll import wait_listed
from launcher.supervisor import Child, GaveUp, RestartPolicy, StartFailed, Stopped, Supervisor, say

HOST = "127.0.0.1"
START_TIMEOUT_S = 180.0
VLLM_START_TIMEOUT_S = 420.0  # vLLM instances starting side by side take minutes on a small machine
WORKER_READY = "pdserve worker ready:"
COORDINATOR_READY = "pdserve coordinator ready:"
COORDINATOR_MANAGEMENT = "pdserve coordinator management"


@dataclass(frozen=True)
class ClusterOptions:
    """What `pdserve up` was asked to start."""

    config: str | None = None
    predict_port: int | None = None
    num_prefill: int = 1
    num_decode: int = 1
    model: str | None = None
    log_level: str | None = None
    tls_dir: str | None = None  # --tls DIR: mutual TLS on every link, certificates made in DIR if absent
    api_keys_file: str | None = None  # --api-keys FILE: SHA-256 digests of the accepted API keys
    restart_backoff_s: float = 0.5  # --restart-backoff: the first restart's delay, doubling up to 10 s
    max_start_failures: int = 5  # --max-start-failures: failed restarts in a row before giving up
    worker_threads: int | None = None  # --worker-threads; None: the cores shared among the workers
    worker_args: tuple[str, ...] = ()  # --worker-args: more `pdserve worker` flags (vllm: `vllm serve` flags)
    engine: str = "pdserve"  # --engine: pdserve workers, or vLLM instances (launcher/vllm_fleet.py)
    vllm_venv: str | None = None  # --vllm-venv: the vLLM environment (default: vllm_fleet.default_vllm_venv)
    loras: tuple[tuple[str, str], ...] = ()  # --lora NAME=PATH: adapters served from the start (loraModules)
    autoscale: bool = False  # --autoscale: the planner on, workers started, stopped and switched to its counts
    max_workers: int | None = None  # --max-workers: most workers --autoscale runs (default: --prefill + --decode)
    autoscale_interval_s: float = 5.0
    speculative: str | None = None  # --speculative ngram|suffix: the decode workers (instances) draft tokens
    num_speculative_tokens: int | None = None  # --num-speculative-tokens; None: the decode worker's default
    gateway: str | None = None  # --gateway envoy: behind Envoy, the picker and sidecars (launcher/gateway_cluster.py)
    num_encode: int = 0  # --encoders: encode workers (a vision-language model's image encoder), registered

    def threads_per_worker(self) -> int:
        """Each worker's torch threads: workers sharing a machine's cores, rather than each taking them all."""
        if self.worker_threads:
            return self.worker_threads
        return max(1, (os.cpu_count() or 1) // (self.most_workers()))

    def most_workers(self) -> int:
        return max(self.max_workers or 0, self.num_prefill + self.num_decode) + self.num_encode

    def speculative_flags(self, role: str) -> list[str]:
        """The `pdserve worker` flags that turn its speculative decoding on: for a decode worker, and under
        --autoscale for every worker (a prefill worker switched to decode in place drafts then); none without
        --speculative."""
        if not self.speculative or (role != "decode" and not self.autoscale):
            return []
        flags = ["--speculative-method", self.speculative]
        if self.num_speculative_tokens is not None:
            flags += ["--num-speculative-tokens", str(self.num_speculative_tokens)]
        return flags


def pdserve_command() -> list[str]:
    """How to start `pdserve` again, so children show up as `pdserve worker --role ...`."""
    script = Path(sys.executable).with_name("pdserve")
    return [sys.executable, str(script)] if script.exists() else [sys.executable, "-m", "launcher.cli"]


def _with_option(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    return argv[:i + 1] + [value] + argv[i + 2:]


def _pin_worker_port(child: Child) -> None:
    """Restart the worker on the gRPC port it bound: the coordinator's static instance list names it."""
    child.argv = _with_option(child.argv, "--port", str(child.port))


def _wait_healthy(supervisor: Supervisor, url: str, timeout_s: float, context=None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2, context=context) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        supervisor.run_for(0.2)  # meanwhile a signal stops us, a child's exit fails the start
    raise RuntimeError(f"{url} did not become healthy within {timeout_s}s")


def _cluster_config(options: ClusterOptions, prefill: list[dict], decode: list[dict], model_dir: str,
                    security: ClusterSecurity) -> dict:
    from coordinator.config import load_config

    base = load_config(options.config).model_dump(by_alias=True) if options.config else {}
    base.setdefault("http_config", {"predict_ip": HOST, "predict_port": 1025})
    base["http_config"]["predict_ip"] = HOST
    if options.predict_port is not None:
        base["http_config"]["predict_port"] = options.predict_port
        if not options.config:
            base["http_config"]["manage_port"] = 0  # beside a chosen port, let the system pick one
    base.setdefault("model_config", {})
    base["model_config"]["modelWeightPath"] = model_dir
    if options.loras:
        modules = base["model_config"].setdefault("loraModules", {})
        modules.update({name: os.path.abspath(path) for name, path in options.loras})
    base["instances"] = {"prefill": prefill, "decode": decode}
    if options.autoscale:  # the workers register; the planner decides how many of each role
        base["planner_config"] = {**base.get("planner_config", {}), "enabled": True,
                                  "max_instances": options.most_workers()}
        # Streams started before a scale-up or a switch move to the new decode workers.
        base["rebalance_config"] = {**base.get("rebalance_config", {}), "enabled": True}
    if options.speculative == "suffix" and options.engine == "pdserve":
        # The draft corpus: earlier outputs go to the decode workers as draft hints, which the suffix method drafts
        # from (ngram reads the request alone; vLLM instances take none).
        base["speculative_config"] = {**base.get("speculative_config", {}), "enabled": True}
    for section, values in security.coordinator_sections().items():
        base.setdefault(section, {}).update(values)
    if options.gateway:  # the picker on a free port; --predict-port is Envoy's then
        base["gateway_config"] = {**base.get("gateway_config", {}), "epp_port": 0}
        base["http_config"]["predict_port"] = base["http_config"]["manage_port"] = 0
    return base


def _worker_argv(options: ClusterOptions, base: list[str], role: str, model_dir: str,
                 security: ClusterSecurity) -> list[str]:
    return base + ["worker", "--role", role, "--model", model_dir, "--host", HOST, "--port", "0", "--security-config",
                   str(security.worker_security_file), "--threads", str(options.threads_per_worker()),
                   *options.speculative_flags(role), *options.worker_args]


def _registered_worker(options: ClusterOptions, base: list[str], role: str, model_dir: str, security: ClusterSecurity,
                       management_url: str, number: int) -> Child:
    """A `pdserve worker` child that registers with the coordinator (not listed in its config)."""
    argv = _worker_argv(options, base, role, model_dir, security) + ["--coordinator", management_url]
    return Child(f"{role} worker {number}", argv, WORKER_READY, on_ready=_pin_worker_port)


def _workers(options: ClusterOptions, base: list[str], model_dir: str,
             security: ClusterSecurity) -> list[tuple[Child, dict | None]]:
    """The worker children, `pdserve worker`s or vLLM instances, each with its instance entry when known before
    it starts (a pdserve worker's is its address, known once it is ready)."""
    if options.engine == "vllm":
        from launcher.vllm_fleet import default_vllm_venv, lora_flags, plan_instances, speculative_config

        venv = Path(options.vllm_venv) if options.vllm_venv else default_vllm_venv()
        extra = lora_flags(options.loras) + options.worker_args
        speculative = (speculative_config(options.speculative, options.num_speculative_tokens)
                       if options.speculative else None)
        return [(Child(f"{instance.role} vllm {instance.index}",
                       instance.argv(venv, model_dir, str(security.run_dir / "worker-secret"), security.tls_dir,
                                     extra, verbose=options.log_level in ("debug", "info"), speculative=speculative),
                       WORKER_READY), instance.entry(security.scheme, speculative))
                for instance in plan_instances(options.num_prefill, options.num_decode, security.run_dir)]
    return [(Child(f"{role} worker {i}", _worker_argv(options, base, role, model_dir, security), WORKER_READY,
                   on_ready=_pin_worker_port), None)
            for role, count in (("prefill", options.num_prefill), ("decode", options.num_decode))
            for i in range(count)]


def _instance_lists(workers: list[tuple[Child, dict | None]]) -> tuple[list[dict], list[dict]]:
    """The prefill and the decode instance entries of `workers` (a pdserve worker's: its address, once ready)."""
    entries = [(child.name, entry or {"address": child.address}) for child, entry in workers]
    return ([entry for name, entry in entries if name.startswith("prefill")],
            [entry for name, entry in entries if name.startswith("decode")])


def _check_config(config: dict) -> None:
    """A coordinator config the coordinator would refuse stops `pdserve up` before anything starts."""
    from coordinator.config import ConfigError, parse_config

    try:
        parse_config(config, "the coordinator's config")
    except ConfigError as exc:
        raise ValueError(f"the coordinator would refuse its config:\n{exc}") from None


def run_local_cluster(options: ClusterOptions) -> int:
    """Start everything, print `pdserve ready: URL`, supervise; stop everything on SIGTERM/SIGINT."""
    model_dir = options.model
    if model_dir is None and options.config:
        from coordinator.config import load_config

        model_dir = load_config(options.config).model_settings.modelWeightPath or None
    if model_dir is None:
        from embedded_model import default_model_dir, ensure_default_model

        print(f"pdserve: preparing the embedded model in {default_model_dir()} ...", flush=True)
        model_dir = str(ensure_default_model())

    supervisor = Supervisor(RestartPolicy(first_backoff_s=options.restart_backoff_s,
                                          max_start_failures=options.max_start_failures,
                                          start_timeout_s=VLLM_START_TIMEOUT_S if options.engine == "vllm"
                                          else START_TIMEOUT_S))
    supervisor.install_signal_handlers()
    base = pdserve_command() + (["--log-level", options.log_level] if options.log_level else [])
    files: list[str] = []
    run_dir = tempfile.TemporaryDirectory(prefix="pdserve-run-")
    try:
        security = ClusterSecurity.prepare(Path(run_dir.name), options.tls_dir, options.api_keys_file)
        if options.autoscale:
            _run_autoscaled(options, supervisor, base, model_dir, security, files)
            supervisor.supervise()
            return 0
        workers = _workers(options, base, model_dir, security)
        if options.engine == "vllm":  # every entry is known before the instances start, which takes minutes
            _check_config(_cluster_config(options, *_instance_lists(workers), model_dir, security))
        print(f"pdserve: starting {len(workers)} {'vLLM instances' if options.engine == 'vllm' else 'workers'} "
              "...", flush=True)
        supervisor.start([child for child, _ in workers])
        config = _cluster_config(options, *_instance_lists(workers), model_dir, security)
        coordinator = _start_coordinator(supervisor, base, config, files)
        _wait_healthy(supervisor, coordinator.address, START_TIMEOUT_S, security.client_ssl_context())
        _start_encoders(options, supervisor, base, model_dir, security, coordinator)
        ready_url = coordinator.address
        if options.gateway:
            ready_url = _start_gateway(options, supervisor, base, coordinator, config, files[-1], security)
        if options.engine == "vllm" or options.gateway:
            why = ("--engine vllm: vLLM instances do not drain on SIGTERM" if options.engine == "vllm" else
                   "--gateway: the sidecars and Envoy are not restarted in turn yet")
            supervisor.signal_handlers[signal.SIGUSR2] = lambda: say(f"rolling restart: not with {why}; SIGUSR2 "
                                                                     "ignored")
        else:
            _rolling_restart(supervisor, coordinator, config, security)
        print(f"pdserve ready: {ready_url}", flush=True)
        supervisor.supervise()
        return 0
    except Stopped:
        return 0
    except (StartFailed, GaveUp, RuntimeError, ValueError) as exc:  # also a --tls folder it cannot complete
        sys.stderr.write(f"pdserve: {exc}\n")  # one write: relayed child output cannot land inside it
        sys.stderr.flush()
        return 1
    finally:
        supervisor.stop_all()
        for path in files:
            os.unlink(path)
        run_dir.cleanup()


def _start_coordinator(supervisor: Supervisor, base: list[str], config: dict, files: list[str]) -> Child:
    """The coordinator child, started and ready; its config file (ports pinned after its first start) is added to
    `files`, removed at the end."""
    fd, config_file = tempfile.mkstemp(prefix="pdserve-", suffix=".json")
    os.close(fd)
    files.append(config_file)
    _write_config(config_file, config)

    def pin_coordinator_ports(child: Child) -> None:
        # A restarted coordinator must serve where clients and the workers' registrations already point.
        http = config["http_config"]
        http["predict_port"] = child.port
        if COORDINATOR_MANAGEMENT in child.announced:
            http["manage_port"] = urlsplit(child.announced[COORDINATOR_MANAGEMENT]).port
        if ENDPOINT_PICKER in child.announced:
            config["gateway_config"]["epp_port"] = urlsplit(child.announced[ENDPOINT_PICKER]).port
        _write_config(config_file, config)

    print("pdserve: starting coordinator ...", flush=True)
    coordinator = Child("coordinator", base + ["coordinator", "--config", config_file], COORDINATOR_READY,
                        on_ready=pin_coordinator_ports)
    supervisor.start([coordinator])
    return coordinator


def _start_gateway(options: ClusterOptions, supervisor: Supervisor, base: list[str], coordinator: Child,
                   config: dict, config_file: str, security: ClusterSecurity) -> str:
    """--gateway envoy: a sidecar per decode worker, then Envoy; the URL clients call (Envoy's listener)."""
    decode = [entry["address"] if "address" in entry else urlsplit(entry["url"]).netloc
              for entry in config["instances"]["decode"]]
    sidecars = start_sidecars(supervisor, base, config_file, decode, coordinator.announced[COORDINATOR_MANAGEMENT])
    envoy = start_envoy(supervisor, security.run_dir, options.predict_port or 0,
                        coordinator.announced[ENDPOINT_PICKER], sidecars, security.envoy_tls())
    for sidecar in sidecars:
        _wait_healthy(supervisor, sidecar.address, START_TIMEOUT_S, security.client_ssl_context())
    token = (security.run_dir / "registration-token").read_text().strip()
    wait_announced(supervisor, coordinator.announced[COORDINATOR_MANAGEMENT], token, len(sidecars), START_TIMEOUT_S,
                   security.client_ssl_context())
    return envoy.address


def _run_autoscaled(options: ClusterOptions, supervisor: Supervisor, base: list[str], model_dir: str,
                    security: ClusterSecurity, files: list[str]) -> None:
    """--autoscale: the coordinator first, then workers that register with it, then the local connector
    (launcher/autoscaler.py) on a timer."""
    from launcher.autoscaler import LocalAutoscaler

    config = _cluster_config(options, [], [], model_dir, security)
    coordinator = _start_coordinator(supervisor, base, config, files)
    management = coordinator.announced[COORDINATOR_MANAGEMENT]
    numbers = itertools.count()

    def new_worker(role: str) -> Child:
        return _registered_worker(options, base, role, model_dir, security, management, next(numbers))

    workers = {new_worker(role): role for role, count in (("prefill", options.num_prefill),
                                                          ("decode", options.num_decode),
                                                          ("encode", options.num_encode)) for _ in range(count)}
    print(f"pdserve: starting {len(workers)} workers (autoscaled up to {options.most_workers()}) ...", flush=True)
    supervisor.start(list(workers))
    _wait_healthy(supervisor, coordinator.address, START_TIMEOUT_S, security.client_ssl_context())
    _wait_encoders(options, supervisor, management, security)
    token = (security.run_dir / "registration-token").read_text().strip()
    scaler = LocalAutoscaler(supervisor, management, token, security.client_ssl_context(), new_worker, workers,
                             options.most_workers(), say)
    restart = _rolling_restart(supervisor, coordinator, config, security,
                               busy=lambda: "the autoscaler's actions are under way" if scaler.pending else "")
    # Paused while a rolling restart runs: the workers it stops and starts are not for the autoscaler to act on.
    supervisor.every(options.autoscale_interval_s, lambda: None if restart.running else scaler.tick())
    print(f"pdserve ready: {coordinator.address}", flush=True)


def _start_encoders(options: ClusterOptions, supervisor: Supervisor, base: list[str], model_dir: str,
                    security: ClusterSecurity, coordinator: Child) -> None:
    """--encoders N: encode workers registering with the coordinator, started and routable."""
    if not options.num_encode:
        return
    management = coordinator.announced[COORDINATOR_MANAGEMENT]
    print(f"pdserve: starting {options.num_encode} encode workers ...", flush=True)
    supervisor.start([_registered_worker(options, base, "encode", model_dir, security, management, i)
                      for i in range(options.num_encode)])
    _wait_encoders(options, supervisor, management, security)


def _wait_encoders(options: ClusterOptions, supervisor: Supervisor, management_url: str,
                   security: ClusterSecurity) -> None:
    """Until the coordinator routes to the --encoders encode workers (each registers once it serves)."""
    if options.num_encode:
        token = (security.run_dir / "registration-token").read_text().strip()
        wait_listed(supervisor, management_url, "/v1/instances", token, options.num_encode,
                    lambda listed: sum(i["state"] == "healthy" for i in listed.get("encode", [])), START_TIMEOUT_S,
                    f"the coordinator did not route to {options.num_encode} encode workers",
                    security.client_ssl_context())


def _rolling_restart(supervisor: Supervisor, coordinator: Child, config: dict, security: ClusterSecurity,
                     busy=lambda: ""):
    """SIGUSR2 to `pdserve up`: restart every process of the cluster, one at a time (launcher/rolling_restart.py)."""
    from launcher.rolling_restart import DEFAULT_DRAIN_S, RollingRestart

    token = (security.run_dir / "registration-token").read_text().strip()
    restart = RollingRestart(supervisor, coordinator, COORDINATOR_MANAGEMENT, token, security.client_ssl_context(),
                             float(config["http_config"].get("drain_seconds", DEFAULT_DRAIN_S)), busy)
    supervisor.signal_handlers[signal.SIGUSR2] = restart.begin
    return restart


def _write_config(path: str, config: dict) -> None:
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
