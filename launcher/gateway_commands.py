"""`pdserve sidecar` (a decode pod's sidecar: coordinator/gateway/sidecar.py) and `pdserve up --gateway`'s checks."""

from __future__ import annotations

import argparse


def add_sidecar_parser(sub) -> None:
    p = sub.add_parser("sidecar", help="serve the client APIs for one decode worker behind an inference gateway")
    p.add_argument("--config", required=True, help="the cluster's ms_coordinator.json")
    p.add_argument("--decode", required=True, metavar="HOST:PORT",
                   help="this pod's decode worker (pdserve: its gRPC address; vllm: as listed in instances.decode)")
    p.add_argument("--port", type=int, required=True, help="port of the client APIs (the InferencePool's targetPort)")
    p.add_argument("--predict-ip", default=None, help="address to listen on (default http_config.predict_ip)")
    p.add_argument("--advertise", default="", metavar="HOST:PORT",
                   help="where the gateway reaches this sidecar (default: the listen address and port)")
    p.add_argument("--announce", default="", metavar="URL",
                   help="the endpoint picker's management URL to announce this sidecar to (default: none)")
    p.set_defaults(func=run_sidecar)


def gateway_refusal(args: argparse.Namespace) -> str:
    """Why `pdserve up` cannot run --gateway as asked; empty when it can (or without --gateway)."""
    if not args.gateway:
        return ""
    if args.autoscale:
        return (f"--gateway {args.gateway} with --autoscale: not supported yet (decode workers the autoscaler starts "
                "would need their sidecars started with them; docs/operating/gateway.md)")
    from launcher.envoy_gateway import envoy_binary

    try:
        envoy_binary()
    except FileNotFoundError as exc:
        return f"--gateway {args.gateway}: {exc}"
    return ""


def run_sidecar(args: argparse.Namespace) -> int:
    def configured():
        from coordinator.config import load_config
        from coordinator.gateway.sidecar import sidecar_settings

        config = load_config(args.config)
        if args.predict_ip is not None:
            config.http_config.predict_ip = args.predict_ip
        return sidecar_settings(config, args.decode, args.port, args.advertise, args.announce)

    from launcher.cli import serve_coordinator

    return serve_coordinator("sidecar", configured)
