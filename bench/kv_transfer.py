"""KV transfer throughput: pdserve's gRPC path vs a raw TCP socket, prefill -> decode, in one run.

    .venv/bin/python bench/kv_transfer.py [--sizes-mb 1 16 64 256] [--repeats 3]

The receiver runs in its own process (as a decode worker does) and verifies every chunk; the
baseline sends the same bytes over a plain socket to a process that only reads them.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kv_transfer.base import TransferredKv  # noqa: E402

NUM_LAYERS = 16


def make_kv(size_mb: int, request_id: str) -> TransferredKv:
    # fp16, [1, 8 heads, seq, 128]: seq chosen so the whole cache is `size_mb` MiB.
    per_position = 2 * NUM_LAYERS * 8 * 128 * 2
    seq = max(1, size_mb * 2**20 // per_position)
    layers = [(torch.randn(1, 8, seq, 128, dtype=torch.float16), torch.randn(1, 8, seq, 128, dtype=torch.float16))
              for _ in range(NUM_LAYERS)]
    return TransferredKv(request_id, layers, first_token_id=1, prefill_time_ms=0.0)


def grpc_receiver(port_queue) -> None:
    import grpc

    from kv_transfer.grpc_transport import GRPC_OPTIONS, KvReceiverServicer
    from proto import worker_pb2_grpc as pb_grpc

    async def main():
        server = grpc.aio.server(options=GRPC_OPTIONS)
        pb_grpc.add_KvReceiverServicer_to_server(KvReceiverServicer(lambda kv: None, lambda *a: None), server)
        port_queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def socket_receiver(port_queue) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_queue.put(srv.getsockname()[1])
    buf = bytearray(4 * 2**20)
    view = memoryview(buf)
    while True:
        conn, _ = srv.accept()
        with conn:
            total = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
            got = 0
            while got < total:
                n = conn.recv_into(view, min(len(buf), total - got))
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
    procs = [ctx.Process(target=grpc_receiver, args=(q,), daemon=True),
             ctx.Process(target=socket_receiver, args=(q,), daemon=True)]
    procs[0].start()
    grpc_port = q.get()
    procs[1].start()
    sock_port = q.get()

    rows = []
    for size in args.sizes_mb:
        kv = make_kv(size, "bench")
        nbytes = kv.num_bytes
        raw = [memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()) for k, v in kv.layers for t in (k, v)]
        socket_times, grpc_times = [], []
        for _ in range(args.repeats):
            socket_times.append(send_socket(sock_port, raw))
            grpc_times.append(asyncio.run(send_grpc(f"127.0.0.1:{grpc_port}", kv)))
        sock_bps = nbytes / statistics.median(socket_times)
        grpc_bps = nbytes / statistics.median(grpc_times)
        rows.append((size, nbytes, sock_bps, grpc_bps))
        print(f"{size} MiB done", file=sys.stderr)

    print("| KV cache | raw TCP socket | pdserve gRPC (CRC32-checked) | gRPC / socket |")
    print("|---:|---:|---:|---:|")
    for size, nbytes, sock_bps, grpc_bps in rows:
        print(f"| {nbytes / 2**20:.0f} MiB | {sock_bps / 1e9:.2f} GB/s | {grpc_bps / 1e9:.2f} GB/s | "
              f"{grpc_bps / sock_bps:.2f}x |")
    for p in procs:
        p.terminate()


if __name__ == "__main__":
    main()
