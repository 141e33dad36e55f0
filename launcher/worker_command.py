"""`pdserve worker`: its flags (every role's: prefill, decode, encode) and its run."""

from __future__ import annotations

import argparse
import sys

from launcher.simulated_worker import add_simulation_flags, simulated_backend
from worker.engine.speculative.config import METHODS as SPECULATIVE_METHODS, SpeculativeConfig

SPECULATIVE_DEFAULTS = SpeculativeConfig()  # the worker flags' defaults are the config's own


def run_worker(args: argparse.Namespace) -> int:
    # Only worker.service here: it imports no torch, so a simulated worker never loads it.
    from security.secrets import SecretError
    from security.settings import SecurityFile, load_security_file
    from security.tls import TlsError
    from telemetry.tracing import TracingSetupError
    from worker.service.options import ModelBackend
    from worker.service.serve import serve

    if args.simulate and args.speculative_method:
        print("pdserve worker --simulate: --speculative-method needs a model: a simulated worker's synthetic tokens "
              "cannot be drafted", file=sys.stderr)
        return 2
    if args.simulate:
        try:
            backend = simulated_backend(args)
        except ValueError as exc:
            print(f"pdserve worker --simulate: {exc}", file=sys.stderr)
            return 2
    else:
        model = args.model
        if model is None:
            from embedded_model import ensure_default_model

            model = str(ensure_default_model())
        try:
            speculative = _speculative_config(args)
        except ValueError as exc:
            print(f"pdserve worker: {exc}", file=sys.stderr)
            return 2
        backend = ModelBackend(model_dir=model, dtype=args.dtype, device=args.device, threads=args.threads,
                               encoder_cache_images=args.encoder_cache_images, max_loras=args.max_loras,
                               max_lora_rank=args.max_lora_rank, attention=args.attention, speculative=speculative,
                               enforce_eager=args.enforce_eager)
    try:
        security = load_security_file(args.security_config) if args.security_config else SecurityFile()
    except ValueError as exc:
        print(f"pdserve worker: invalid --security-config:\n{exc}", file=sys.stderr)
        return 2
    auth = security.auth_config.model_copy(update={
        k: v for k, v in (("registration_token_file", args.registration_token_file),
                          ("worker_secret_file", args.worker_secret_file)) if v is not None})
    try:
        options = _worker_options(args, backend, security, auth)
    except ValueError as exc:
        print(f"pdserve worker: {exc}", file=sys.stderr)
        return 2
    try:
        from launcher.cli import run_event_loop

        run_event_loop(serve(options))
    except (TlsError, SecretError, TracingSetupError) as exc:
        print(f"pdserve worker: cannot start:\n{exc}", file=sys.stderr)
        return 2
    return 0


def _speculative_config(args):
    """The decode worker's drafting settings from its flags; None without --speculative-method."""
    if not args.speculative_method:
        return None  # a prefill worker keeps it for when it is switched to decode
    return SpeculativeConfig(args.speculative_method, args.num_speculative_tokens, args.prompt_lookup_min,
                             args.prompt_lookup_max, args.speculative_disable_batch_size)


def _worker_options(args, backend, security, auth):
    from worker.service.options import WorkerOptions

    return WorkerOptions(role=args.role, backend=backend, host=args.host, port=args.port,
                         kv_trans_timeout_s=args.kv_trans_timeout, kv_lease_timeout_s=args.kv_lease_timeout,
                         kv_budget_tokens=args.kv_budget_tokens, max_prefill_tokens=args.max_prefill_tokens,
                         block_size=args.block_size, prefix_caching=not args.no_prefix_caching,
                         kv_tier_dir=args.kv_tier_dir, kv_tier_gb=args.kv_tier_gb,
                         max_prefill_batch_size=args.max_prefill_batch_size, max_running=args.max_running,
                         kv_data_port=args.kv_data_port, metrics_port=args.metrics_port,
                         health_port=args.health_port,
                         token_channel_port=args.token_channel_port,
                         coordinator_url=args.coordinator, heartbeat_interval_s=args.heartbeat_interval,
                         advertise_host=args.advertise_host, drain_seconds=args.drain_seconds,
                         max_encode_batch_images=args.max_encode_batch_images,
                         tls=security.tls_config, auth=auth)


def add_worker_parser(sub) -> None:
    """The `pdserve worker` subcommand."""
    p = sub.add_parser("worker", help="run a prefill, decode or encode worker")
    p.add_argument("--role", required=True, choices=["prefill", "decode", "encode"],
                   help="serve prefill (builds KV caches and sends them), decode (receives them, generates tokens) "
                        "or encode (a vision-language model's image encoder: its outputs pulled by prefill workers)")
    p.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on: the gRPC, metrics, health, KV data and token channel ports "
                        "(0.0.0.0 for all; see --advertise-host)")
    p.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and compute dtype; auto: the checkpoint's own (its config.json)")
    p.add_argument("--kv-trans-timeout", type=float, default=10.0,
                   help="decode: seconds a KV transfer that has started may go without a block before it fails (the "
                        "wait before it starts is bounded by the coordinator's first_token_timeout)")
    p.add_argument("--kv-lease-timeout", type=float, default=30.0,
                   help="seconds a prefill worker holds a KV cache for the decode worker to confirm")
    p.add_argument("--kv-budget-tokens", type=int, default=None,
                   help="KV block pool size in token positions (default: 40%% of the memory free at start-up, at "
                        "most 4 GiB on the CPU)")
    p.add_argument("--max-prefill-tokens", type=int, default=2048,
                   help="prompt tokens per forward: longer prompts are prefilled in chunks of at most this many; on a "
                        "decode worker a local prefill's chunk shares a step with decoding")
    p.add_argument("--max-prefill-batch-size", type=int, default=16, help="prompts (chunks) per prefill forward")
    p.add_argument("--block-size", type=int, default=16, help="token positions per KV block (paged KV cache)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not keep full KV blocks for later prompts that start with the same tokens")
    p.add_argument("--kv-tier-dir", default=None, metavar="DIR",
                   help="keep prefix-cache blocks the pool evicts in a file in DIR (local disk), loaded back instead "
                        "of recomputed (with --kv-tier-gb)")
    p.add_argument("--kv-tier-gb", type=float, default=0.0, metavar="GB",
                   help="the KV tier's size in GiB (0: no tier); the file is made whole at start-up")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads of this worker (default: torch's own, one per core)")
    p.add_argument("--encoder-cache-images", type=int, default=None, metavar="N",
                   help="vision-language models: image encoder outputs kept by content hash, so an image seen again "
                        "is not encoded again (0: off; default 32, 256 on an encode worker)")
    p.add_argument("--max-encode-batch-images", type=int, default=16, metavar="N",
                   help="encode: images of concurrent requests encoded in one vision forward, at most")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="LoRA adapters resident at once, loaded on demand and evicted least recently used; requests "
                        "for another wait while all N are in use (default: 4 on a text model; 0: no adapters)")
    p.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                   help="the largest LoRA rank this worker loads (an adapter above it is refused)")
    p.add_argument("--device", default="auto",
                   help="auto|cpu|cuda|cuda:N: where the model and KV pool live (auto: CUDA when present)")
    p.add_argument("--attention", default="auto", choices=("auto", "kernel", "torch"),
                   help="kernel: the engine's paged-attention kernel, reading blocks where they lie (CPU; built with "
                        "the machine's C++ compiler); torch: blocks gathered, then SDPA (the reference; CUDA); "
                        "auto: the kernel on the CPU when it builds, else torch")
    p.add_argument("--max-running", type=int, default=64, help="sequences per decode step")
    p.add_argument("--enforce-eager", action="store_true",
                   help="decode: never capture decode steps as CUDA graphs (on a CUDA device they are captured at "
                        "start-up, one per batch and context bucket; elsewhere steps always run eagerly)")
    p.add_argument("--speculative-method", default=None, choices=SPECULATIVE_METHODS,
                   help="decode: draft tokens from the request's own text and verify them in one forward; ngram: "
                        "prompt lookup (vLLM's); suffix: suffix matching over the text and the coordinator's hints "
                        "(default: no drafting)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="decode: draft tokens per row and step, at most, in [1, 32] (default: 5 for ngram, 16 for "
                        "suffix, whose drafts are only as long as their matches warrant)")
    p.add_argument("--prompt-lookup-min", type=int, default=SPECULATIVE_DEFAULTS.prompt_lookup_min, metavar="N",
                   help="ngram: the shortest suffix of the text that may match earlier in it")
    p.add_argument("--prompt-lookup-max", type=int, default=SPECULATIVE_DEFAULTS.prompt_lookup_max, metavar="N",
                   help="ngram: the longest suffix looked for (the longest match wins, the earliest on ties)")
    p.add_argument("--speculative-disable-batch-size", type=int, default=SPECULATIVE_DEFAULTS.disable_batch_size,
                   metavar="N",
                   help="decode: no drafting in a step of more than N rows (compute-bound, where drafts cost)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics port (0 picks one, -1 disables it)")
    p.add_argument("--health-port", type=int, default=-1,
                   help="plaintext port serving only grpc.health.v1, for probes that speak no TLS when "
                        "tls_config.worker_grpc is on (0 picks one; default -1: none, the gRPC port answers it)")
    p.add_argument("--kv-data-port", type=int, default=0,
                   help="decode: raw-TCP KV receiver port (0 picks one, -1 disables it: KV over gRPC only)")
    p.add_argument("--token-channel-port", type=int, default=0,
                   help="token channel port, one connection per coordinator carrying its decode requests and their "
                        "tokens (decode) or its prefills (prefill); 0 picks one, -1 disables it: a gRPC call per "
                        "request")
    p.add_argument("--advertise-host", default=None,
                   help="host the coordinator and other workers dial (e.g. the pod IP when --host is 0.0.0.0)")
    p.add_argument("--coordinator", default=None,
                   help="coordinator management URL to register with, e.g. http://127.0.0.1:1026; several, comma-"
                        "separated, are tried in turn when the one in use is unreachable (default: none)")
    p.add_argument("--heartbeat-interval", type=float, default=2.0,
                   help="seconds between heartbeats to --coordinator (its register answer may override it)")
    p.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM: seconds to let requests in flight finish before stopping anyway")
    p.add_argument("--security-config", default=None,
                   help="ms_coordinator.json (or a file with only tls_config and auth_config): this worker's TLS "
                        "links and secret files (relative paths are taken from the file's folder)")
    p.add_argument("--registration-token-file", default=None,
                   help="token proving this worker to the coordinator (overrides auth_config.registration_token_file)")
    p.add_argument("--worker-secret-file", default=None,
                   help="secret gRPC callers must present (overrides auth_config.worker_secret_file)")
    add_simulation_flags(p)
    p.set_defaults(func=run_worker)
