"""Start one vLLM instance as a pdserve prefill or decode worker: `vllm serve` with the NIXL connector, KV events,
the fixes of launcher/vllm_site, and pdserve's ready line once it serves.

Run with the vLLM venv's own Python (it imports nothing of pdserve, whose environment vLLM cannot share):

    .vllm-venv/bin/python launcher/vllm_serve.py --role prefill --port 8100 --side-channel-port 5600 \\
        --model DIR [--kv-events ENDPOINT] [--cores 0] [--api-key-file F] [--ssl-certfile F --ssl-keyfile F \\
        --ssl-ca-certs F] [--speculative-config JSON] [--verbose] [-- more vllm serve flags]

1. The environment: VLLM_CPU_KVCACHE_SPACE, the NIXL side channel on 127.0.0.1, UCX over loopback, the OMP
   threads bound to `--cores`, and launcher/vllm_site first on PYTHONPATH (its sitecustomize applies the fixes).
2. `vllm serve` runs as a child that dies with this process; its output is relayed, INFO lines only with
   --verbose (prompts never reach them).
3. When its server is up, `pdserve worker ready: 127.0.0.1:PORT` goes to stdout (what `pdserve up` waits for).
4. SIGTERM / SIGINT go on to the child; this process exits with its code.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

HOST = "127.0.0.1"
READY_LINE = "Application startup complete."
INFO = re.compile(r"^(\(\w+ pid=\d+\) )?INFO\b")
SITE = Path(__file__).resolve().parent / "vllm_site"
PR_SET_PDEATHSIG = 1
# NIXL's progress thread: this many microseconds between polls instead of spinning a core (vllm_site).
NIXL_PTHR_DELAY_US = 200


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", required=True, choices=["prefill", "decode"],
                   help="prefill: NIXL kv_producer; decode: kv_consumer")
    p.add_argument("--model", required=True, help="model folder")
    p.add_argument("--port", type=int, required=True, help="HTTP port on 127.0.0.1")
    p.add_argument("--side-channel-port", type=int, required=True, help="NIXL handshake port on 127.0.0.1")
    p.add_argument("--kv-events", default="", help="ZMQ endpoint vLLM binds for its KV events (ipc://PATH or "
                   "tcp://*:PORT); empty = none")
    p.add_argument("--cores", default="auto", help="VLLM_CPU_OMP_THREADS_BIND: cores for its OMP threads")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--served-model-name", default="", help="the name clients of the instance itself pass as `model` "
                   "(pdserve sends none); default: the model folder's path")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--api-key-file", default="", help="file whose first line is the key vLLM requires (--api-key)")
    p.add_argument("--ssl-certfile", default="")
    p.add_argument("--ssl-keyfile", default="")
    p.add_argument("--ssl-ca-certs", default="", help="with it, clients must present a certificate it signed")
    p.add_argument("--speculative-config", default="", metavar="JSON",
                   help="decode: vLLM's --speculative-config (JSON with method ngram or suffix, "
                   "num_speculative_tokens, ...); a prefill instance drafts nothing")
    p.add_argument("--verbose", action="store_true", help="relay vLLM's INFO lines too")
    p.add_argument("extra", nargs="*", help="more `vllm serve` flags, after --")
    return p


def serve_command(args: argparse.Namespace) -> list[str]:
    """The `vllm serve` command line for `args`."""
    kv_transfer = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu",
                   "kv_role": "kv_producer" if args.role == "prefill" else "kv_consumer"}
    command = [str(Path(sys.executable).with_name("vllm")), "serve", args.model, "--host", HOST,
               "--port", str(args.port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
               "--kv-transfer-config", json.dumps(kv_transfer), "--disable-uvicorn-access-log",
               # pdserve's guided decoding hands over llguidance grammars: only the guidance backend reads them.
               "--structured-outputs-config", json.dumps({"backend": "guidance"})]
    if args.served_model_name:
        command += ["--served-model-name", args.served_model_name]
    if args.kv_events:
        command += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                      "endpoint": args.kv_events})]
    if args.ssl_certfile:
        command += ["--ssl-certfile", args.ssl_certfile, "--ssl-keyfile", args.ssl_keyfile]
    if args.ssl_ca_certs:
        command += ["--ssl-ca-certs", args.ssl_ca_certs, "--ssl-cert-reqs", "2"]  # 2: CERT_REQUIRED
    if args.speculative_config:
        command += ["--speculative-config", args.speculative_config]
    return command + list(args.extra)


def serve_environment(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": f"{args.kv_cache_gb:g}",
        "VLLM_CPU_OMP_THREADS_BIND": args.cores,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(args.side_channel_port),
        "UCX_NET_DEVICES": "lo",
        "PDSERVE_NIXL_PTHR_DELAY_US": str(NIXL_PTHR_DELAY_US),
        "PDSERVE_VLLM_KEEP_AFFINITY": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH", "")])),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    })
    if "--enable-lora" in args.extra:  # adapters load and unload at run time (the coordinator's management port)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if args.api_key_file:  # as vLLM's --api-key, kept off the command line (ps shows it to every user)
        env["VLLM_API_KEY"] = Path(args.api_key_file).read_text().strip().splitlines()[0].strip()
    return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.speculative_config:
        if args.role != "decode":
            parser.error("--speculative-config is for a decode instance: a prefill instance computes one token a "
                         "request and drafts nothing")
        try:
            json.loads(args.speculative_config)
        except json.JSONDecodeError as exc:
            parser.error(f"--speculative-config is not JSON: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    parent = os.getpid()

    def die_with_parent() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # this wrapper died before prctl: nothing would stop the child
            os._exit(1)

    child = subprocess.Popen(serve_command(args), env=serve_environment(args), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, errors="replace", preexec_fn=die_with_parent)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    ready = False
    for line in child.stdout:
        if not ready and READY_LINE in line:
            ready = True
            print(f"pdserve worker ready: {HOST}:{args.port}", flush=True)
        if args.verbose or not INFO.match(line):
            sys.stderr.write(line)
            sys.stderr.flush()
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
