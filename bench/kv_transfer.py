"""KV transfer throughput: pdserve's two KV paths vs a raw TCP socket, prefill -> decode, one run.

    .venv/bin/python bench/kv_transfer.py [--sizes-mb 1 16 64 256] [--repeats 3]

Each receiver runs in its own process (as a decode worker does) and verifies every block's
checksum into pooled buffers. The baseline sends the same bytes over a plain socket to a process
that keeps them in one reused full-size buffer ("kept": what any receiver of a KV cache must do);
"scratch" reads them into a reused 4 MiB buffer that stays in the CPU cache, an upper bound no
receiver that keeps the cache can reach. "pdserve TCP" is the path workers use by default (the decode
worker announces its KV receiver); "pdserve gRPC" is the PushKv fallback.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kv_transfer.base import TransferredKv  # noqa: E402
from kv_transfer.sink import KvSink  # noqa: E402
from kv_transfer.transfer_tokens import KvTransferTokens  # noqa: E402

NUM_LAYERS = 16


def make_kv(size_mb: int, request_id: str) -> TransferredKv:
    # fp16, [1, 8 heads, seq, 128]: seq chosen so the whole cache is `size_mb` MiB.
    per_position = 2 * NUM_LAYERS * 8 * 128 * 2
    seq = max(1, size_mb * 2**20 // per_position)
    layers = [(torch.randn(1, 8, seq, 128, dtype=torch.float16), torch.randn(1, 8, seq, 128, dtype=torch.float16))
              for _ in range(NUM_LAYERS)]
    return TransferredKv(request_id, layers, first_token_id=1, prefill_time_ms=0.0)


def bench_tokens(num_transfers: int) -> tuple[KvTransferTokens, list[str]]:
    """A receiver's one-time tokens for transfers "bench-0" .. "bench-{n-1}", as a decode worker issues them."""
    tokens = KvTransferTokens()
    return tokens, [tokens.issue(f"bench-{i}") for i in range(num_transfers)]


def grpc_receiver(port_queue, num_transfers: int) -> None:
    import grpc

    from kv_transfer.buffer_pool import KvBufferPool
    from kv_transfer.grpc_transport import GRPC_OPTIONS, KvReceiverServicer
    from proto import worker_pb2_grpc as pb_grpc

    async def main():
        server = grpc.aio.server(options=GRPC_OPTIONS)
        pool = KvBufferPool()
        tokens, issued = bench_tokens(num_transfers)
        servicer = KvReceiverServicer(KvSink(lambda kv: kv.release(), lambda *a: None, tokens, pool=pool))
        pb_grpc.add_KvReceiverServicer_to_server(servicer, server)
        port_queue.put((server.add_insecure_port("127.0.0.1:0"), issued))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def tcp_receiver(port_queue, num_transfers: int) -> None:
    from kv_transfer.buffer_pool import KvBufferPool
    from kv_transfer.tcp_transport import TcpKvReceiver

    async def main():
        # As in a decode worker: the cache is copied into the batch, then its buffer is reused.
        tokens, issued = bench_tokens(num_transfers)
        rx = TcpKvReceiver(KvSink(lambda kv: kv.release(), lambda *a: None, tokens, pool=KvBufferPool()),
                           timeout_s=600)
        port_queue.put((await rx.start("127.0.0.1", 0), issued))
        await asyncio.Event().wait()

    asyncio.run(main())


def socket_receiver(port_queue, keep: bool) -> None:
    """Reads the bytes into one reused 4 MiB scratch buffer, or (keep) into a reused full-size
    buffer, as any receiver that keeps the cache must; both reuse memory, so no page faults."""
    srv = socket.create_server(("127.0.0.1", 0))
    port_queue.put(srv.getsockname()[1])
    scratch = memoryview(bytearray(4 * 2**20))
    stores: dict[int, memoryview] = {}
    while True:
        conn, _ = srv.accept()
        with conn:
            total = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
            if keep and total not in stores:
                stores[total] = memoryview(bytearray(total))
            store = stores.get(total)
            got = 0
            while got < total:
                view = store[got:] if keep else scratch[: min(len(scratch), total - got)]
                n = conn.recv_into(view)
                if n == 0:
                    break
                got += n
            conn.sendall(got.to_bytes(8, "little"))


def send_socket(port: int, payload: list[memoryview]) -> float:
    total = sum(len(p) for p in payload)
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(total.to_bytes(8, "little"))
        for part in payload:
            conn.sendall(part)
        assert int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little") == total
    return time.perf_counter() - start


async def send_tcp(address: str, kv: TransferredKv) -> float:
    from kv_transfer.tcp_transport import TcpKvSender

    start = time.perf_counter()
    await TcpKvSender().send(address, kv)
    return time.perf_counter() - start


async def send_grpc(address: str, kv: TransferredKv) -> float:
    from kv_transfer.grpc_transport import GrpcKvSender

    sender = GrpcKvSender(timeout_s=600)
    try:
        start = time.perf_counter()
        await sender.send(address, kv)
        return time.perf_counter() - start
    finally:
        await sender.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = []
    num_transfers = len(args.sizes_mb) * args.repeats
    procs = [ctx.Process(target=grpc_receiver, args=(q, num_transfers), daemon=True),
             ctx.Process(target=tcp_receiver, args=(q, num_transfers), daemon=True),
             ctx.Process(target=socket_receiver, args=(q, False), daemon=True),
             ctx.Process(target=socket_receiver, args=(q, True), daemon=True)]
    for p in procs:
        p.start()
        ports.append(q.get())
    (grpc_port, grpc_tokens), (tcp_port, tcp_tokens), scratch_port, keep_port = ports
    transfers = iter(range(num_transfers))

    rows = []
    for size in args.sizes_mb:
        kv = make_kv(size, "bench")
        nbytes = kv.num_bytes
        raw = [memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()) for k, v in kv.layers for t in (k, v)]
        times = {"scratch": [], "keep": [], "tcp": [], "grpc": []}
        for _ in range(args.repeats):
            i = next(transfers)
            times["scratch"].append(send_socket(scratch_port, raw))
            times["keep"].append(send_socket(keep_port, raw))
            tcp_kv = dataclasses.replace(kv, request_id=f"bench-{i}", transfer_token=tcp_tokens[i])
            times["tcp"].append(asyncio.run(send_tcp(f"127.0.0.1:{tcp_port}", tcp_kv)))
            grpc_kv = dataclasses.replace(kv, request_id=f"bench-{i}", transfer_token=grpc_tokens[i])
            times["grpc"].append(asyncio.run(send_grpc(f"127.0.0.1:{grpc_port}", grpc_kv)))
        rows.append((nbytes, *(nbytes / statistics.median(times[k]) for k in ("scratch", "keep", "tcp", "grpc"))))
        print(f"{size} MiB done", file=sys.stderr)

    gb = 1e9
    print("| KV cache | socket, 4 MiB scratch | socket, kept (baseline) | pdserve TCP (default) | vs kept "
          "| vs scratch | pdserve gRPC PushKv | vs kept |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for nbytes, scratch, keep, tcp, grpc_bps in rows:
        print(f"| {nbytes / 2**20:.0f} MiB | {scratch / gb:.2f} GB/s | {keep / gb:.2f} GB/s | {tcp / gb:.2f} GB/s | "
              f"{tcp / keep:.2f}x | {tcp / scratch:.2f}x | {grpc_bps / gb:.2f} GB/s | {grpc_bps / keep:.2f}x |")
    for p in procs:
        p.terminate()


if __name__ == "__main__":
    main()
