"""`pdserve sidecar`: a decode pod's sidecar behind a Gateway API inference gateway (coordinator/gateway/sidecar.py)."""

from __future__ import annotations

import argparse
import sys


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


def run_sidecar(args: argparse.Namespace) -> int:
    from coordinator.config import ConfigError, load_config
    from coordinator.gateway.sidecar import sidecar_settings
    from coordinator.http.server import run_coordinator
    from launcher.cli import run_event_loop
    from security.secrets import SecretError
    from security.tls import TlsError

    try:
        config = load_config(args.config)
        if args.predict_ip is not None:
            config.http_config.predict_ip = args.predict_ip
        config = sidecar_settings(config, args.decode, args.port, args.advertise, args.announce)
    except ConfigError as exc:
        print(f"pdserve sidecar: invalid config:\n{exc}", file=sys.stderr)
        return 2
    try:
        run_event_loop(run_coordinator(config))
    except (ConfigError, TlsError, SecretError) as exc:
        print(f"pdserve sidecar: cannot start:\n{exc}", file=sys.stderr)
        return 2
    return 0
