"""`pdserve profile` and `pdserve plan`: their flags, their checks (exit 2 naming the flag) and their output."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path


class UsageError(ValueError):
    """A flag's value out of range; the message names the flag."""


def add_profile_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker", required=True, metavar="HOST:PORT", help="the worker's gRPC address")
    p.add_argument("--role", required=True, choices=["prefill", "decode"],
                   help="the worker's role: prefill times prompt lengths, decode times batch sizes")
    p.add_argument("--out", default=None, metavar="FILE", help="profile JSON to write (default: ROLE-profile.json)")
    p.add_argument("--prompt-tokens", default="16,64,128,256,512,1024", metavar="N,N,...",
                   help="prefill: prompt lengths to time")
    p.add_argument("--repeats", type=int, default=3, help="prefill: calls per prompt length")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32", metavar="N,N,...",
                   help="decode: batch sizes to time (at most the worker's --max-running)")
    p.add_argument("--context-tokens", default="64,512", metavar="N,N,...", help="decode: prompt lengths per batch")
    p.add_argument("--decode-steps", type=int, default=12, help="decode: tokens per sequence per measurement")
    p.add_argument("--kv-host", default="127.0.0.1",
                   help="prefill: the address the worker can reach this machine on (for its KV stream)")
    p.add_argument("--worker-secret-file", default=None, help="the secret the worker requires, if any")


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-profile", required=True, metavar="FILE", help="from pdserve profile --role prefill")
    p.add_argument("--decode-profile", required=True, metavar="FILE", help="from pdserve profile --role decode")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", metavar="TRACE.jsonl",
                        help="one JSON object per line: {arrival_s, prompt_tokens, output_tokens}")
    source.add_argument("--synthetic", metavar="SPEC",
                        help="rate=R,count=N|duration=S,prompt=DIST,output=DIST[,arrivals=poisson|uniform][,seed=S]; "
                             "DIST is N, uniform:LO:HI or normal:MEAN:STD")
    p.add_argument("--ttft-ms", type=float, required=True, help="TTFT target at the percentile, ms")
    p.add_argument("--tpot-ms", type=float, required=True, help="TPOT target at the percentile, ms")
    p.add_argument("--percentile", type=float, default=90.0, help="(0, 100]")
    p.add_argument("--policy", default="load_balance", choices=["load_balance", "round_robin"],
                   help="the coordinator's digs_scheduler_config.algorithm_type to model")
    p.add_argument("--max-running", type=int, default=64, help="the decode workers' --max-running")
    p.add_argument("--max-prefill-tokens", type=int, default=2048,
                   help="the workers' --max-prefill-tokens (prompt tokens per forward; on a decode worker, of its "
                        "preempted sequences' recomputations)")
    p.add_argument("--max-prefill-batch-size", type=int, default=16,
                   help="the workers' --max-prefill-batch-size")
    p.add_argument("--block-size", type=int, default=16,
                   help="the decode workers' --block-size (their KV capacity is counted in blocks of it)")
    p.add_argument("--max-instances", type=int, default=64, help="most instances of a role to consider")
    p.add_argument("--json", action="store_true", help="print the recommendation as JSON")


def _at_least(flag: str, value: int, low: int, high: int = 1_000_000) -> int:
    if not low <= value <= high:
        raise UsageError(f"{flag}: must be in [{low}, {high}], got {value}")
    return value


def _lengths(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"{flag}: expected whole numbers separated by commas, got {text!r}") from None
    return tuple(sorted({_at_least(flag, v, 1) for v in values}))


def _progress(done: int, total: int, what: str) -> None:
    print(f"pdserve profile: [{done}/{total}] {what}", file=sys.stderr, flush=True)


def run_profile(args: argparse.Namespace) -> int:
    from planner.profiler import (
        STEPS_SKIPPED,
        ProfileFailed,
        ProfileSettings,
        profile_worker,
    )

    try:
        settings = ProfileSettings(
            prompt_tokens=_lengths("--prompt-tokens", args.prompt_tokens),
            batch_sizes=_lengths("--batch-sizes", args.batch_sizes),
            context_tokens=_lengths("--context-tokens", args.context_tokens),
            repeats=_at_least("--repeats", args.repeats, 1, 100),
            decode_steps=_at_least("--decode-steps", args.decode_steps, STEPS_SKIPPED + 2, 10_000),
            kv_host=args.kv_host)
        host, sep, port = args.worker.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise UsageError(f"--worker: expected HOST:PORT, got {args.worker!r}")
        metadata = _secret_metadata(args.worker_secret_file)
        out = Path(args.out or f"{args.role}-profile.json")
        if not out.parent.is_dir() or not os.access(out.parent, os.W_OK) or out.is_dir():
            # Checked now: a profile measured for minutes must not be lost to a path it cannot be written to.
            raise UsageError(f"--out: cannot write {str(out)!r} (its folder must exist and be writable)")
    except UsageError as exc:
        print(f"pdserve profile: {exc}", file=sys.stderr)
        return 2
    try:
        profile = asyncio.run(profile_worker(args.worker, args.role, settings, _progress, metadata))
    except ProfileFailed as exc:
        print(f"pdserve profile: {exc}", file=sys.stderr)
        return 1
    profile.save(out)
    if profile.prefill is not None:
        c = profile.prefill
        print(f"prefill: {c.base_ms:.2f} ms + {c.ms_per_token:.4f} ms/token; handoff {c.handoff_base_ms:.2f} ms + "
              f"{c.handoff_ms_per_mib:.2f} ms/MiB; KV {c.kv_bytes_per_token:.0f} bytes/token")
    else:
        c = profile.decode
        print(f"decode step: {c.base_ms:.2f} ms + {c.ms_per_seq:.3f} ms/sequence + "
              f"{c.ms_per_context_token:.6f} ms/context token")
    print(f"wrote {out}")
    return 0


def _secret_metadata(path: str | None):
    if path is None:
        return None
    from security.grpc_auth import secret_metadata
    from security.secrets import SecretError, SecretFile

    try:
        return secret_metadata(SecretFile("--worker-secret-file", path))
    except SecretError as exc:
        raise UsageError(str(exc)) from None


def run_plan(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from planner.plan import NoPlanError, Planner
    from planner.profile import ProfileError, WorkerProfile
    from planner.simulation import SimulationError, SimulationStalled, WorkerSettings
    from planner.slo import Slo
    from planner.workload import SyntheticWorkload, WorkloadError, describe, load_trace

    try:
        try:
            slo = Slo(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, percentile=args.percentile)
        except ValidationError as exc:
            field = str(exc.errors()[0]["loc"][0])
            raise UsageError(f"--{field.replace('_', '-')}: {describe(exc, Slo).split(': ', 1)[1]}") from None
        settings = WorkerSettings(max_running=_at_least("--max-running", args.max_running, 1),
                                  max_prefill_tokens=_at_least("--max-prefill-tokens", args.max_prefill_tokens, 1),
                                  max_prefill_batch_size=_at_least("--max-prefill-batch-size",
                                                                   args.max_prefill_batch_size, 1),
                                  block_size=_at_least("--block-size", args.block_size, 1))
        max_instances = _at_least("--max-instances", args.max_instances, 1, 1024)
        try:
            workload = load_trace(Path(args.workload)) if args.workload else \
                SyntheticWorkload.parse(args.synthetic).generate()
        except WorkloadError as exc:
            raise UsageError(f"{'--workload' if args.workload else '--synthetic'}: {exc}") from None
        profiles = {}
        for role, path in (("prefill", args.prefill_profile), ("decode", args.decode_profile)):
            try:
                profiles[role] = WorkerProfile.load(Path(path), role)
            except ProfileError as exc:
                raise UsageError(f"--{role}-profile: {exc}") from None
        planner = Planner(workload, profiles["prefill"], profiles["decode"], slo, settings, args.policy, max_instances)
        recommendation = planner.recommend()
    except (UsageError, SimulationError) as exc:
        print(f"pdserve plan: {exc}", file=sys.stderr)
        return 2
    except (NoPlanError, SimulationStalled) as exc:
        print(f"pdserve plan: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"slo": slo.model_dump(), "span_s": workload.span_s, **recommendation.as_dict()}, indent=2))
    else:
        print(format_recommendation(recommendation, slo, workload.span_s))
    return 0


def format_recommendation(recommendation, slo, span_s: float) -> str:
    p = f"p{slo.percentile:g}"
    header = ("cluster", "prefill", "decode", "goodput req/s", f"{p} TTFT ms", f"{p} TPOT ms", "SLOs")
    rows = [("recommended", recommendation.chosen)] + [
        (f"one fewer {role}", prediction) for role, prediction in recommendation.one_fewer.items() if prediction]
    table = [header] + [(name, str(x.num_prefill), str(x.num_decode), f"{x.report.goodput_rps:.2f}",
                         f"{x.report.ttft_ms:.1f}", f"{x.report.tpot_ms:.1f}", "met" if x.report.met else "missed")
                        for name, x in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    chosen = recommendation.chosen
    lines += [
        (f"SLOs: {p} TTFT <= {slo.ttft_ms:g} ms, {p} TPOT <= {slo.tpot_ms:g} ms; goodput counts requests within "
         f"both over {span_s:g} s ({chosen.report.num_good} of {chosen.report.num_requests})"),
        (f"bottleneck: {recommendation.bottleneck} ({'TTFT' if recommendation.bottleneck == 'prefill' else 'TPOT'} "
         f"has the least headroom); busy: prefill {chosen.prefill_utilisation:.0%}, decode "
         f"{chosen.decode_utilisation:.0%} (mean batch {chosen.mean_decode_batch:.1f})"),
    ]
    return "\n".join(lines)
