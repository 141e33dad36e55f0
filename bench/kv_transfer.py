"""KV transfer throughput: pdserve's two KV paths vs a raw TCP socket, prefill -> decode, one run.

    .venv/bin/python bench/kv_transfer.py [--sizes-mb 1 16 64 256] [--repeats 3] [--no-tls]

Each receiver runs in its own process (as a decode worker does) and verifies every block's
checksum into pooled buffers. The baseline sends the same bytes over a plain socket to a process
that keeps them in one reused full-size buffer ("kept": what any receiver of a KV cache must do);
"scratch" reads them into a reused 4 MiB buffer that stays in the CPU cache, an upper bound no
receiver that keeps the cache can reach. "pdserve TCP" is the path workers use by default (the decode
worker announces its KV receiver); "pdserve gRPC" is the PushKv fallback.

A second table repeats the kept socket, pdserve TCP and gRPC over mutual TLS (certificates from
security/certificates.py, the contexts the workers build: security/tls.py), interleaved with the
plaintext transfers of the same run, each connection paying its handshake as a worker's does.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kv_transfer.base import TransferredKv  # noqa: E402
from kv_transfer.sink import KvSink  # noqa: E402
from kv_transfer.transfer_tokens import KvTransferTokens  # noqa: E402

NUM_LAYERS = 16


def tls_link(cert_dir: str | None, side: str, link: str = "tls_config.kv_transfer"):
    """Mutual TLS as `pdserve up --tls` sets it up: the server presents server.pem, the client client.pem."""
    if cert_dir is None:
        return None
    from security.settings import TlsLink
    from security.tls import LinkTls

    leaf = Path(cert_dir) / ("server" if side == "server" else "client")
    return LinkTls(link, TlsLink(tls_enable=True, mutual_tls=True, ca_cert=str(Path(cert_dir) / "ca.pem"),
                                 tls_cert=f"{leaf}.pem", tls_key=f"{leaf}-key.pem"), side)


def make_kv(size_mb: int, request_id: str) -> TransferredKv:
    # fp16, [seq, 8 heads, 128] (the wire's layout): seq chosen so the whole cache is `size_mb` MiB.
    per_position = 2 * NUM_LAYERS * 8 * 128 * 2
    seq = max(1, size_mb * 2**20 // per_position)
    layers = [(torch.randn(seq, 8, 128, dtype=torch.float16), torch.randn(seq, 8, 128, dtype=torch.float16))
              for _ in range(NUM_LAYERS)]
    return TransferredKv(request_id, layers, first_token_id=1, prefill_time_ms=0.0)


def bench_tokens(num_transfers: int) -> tuple[KvTransferTokens, list[str]]:
    """A receiver's one-time tokens for transfers "bench-0" .. "bench-{n-1}", as a decode worker issues them."""
    tokens = KvTransferTokens()
    return tokens, [tokens.issue(f"bench-{i}") for i in range(num_transfers)]


def grpc_receiver(port_queue, num_transfers: int, cert_dir: str | None = None) -> None:
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
        tls = tls_link(cert_dir, "server", "tls_config.worker_grpc")
        port = (server.add_secure_port("127.0.0.1:0", tls.grpc_server_credentials()) if tls
                else server.add_insecure_port("127.0.0.1:0"))
        port_queue.put((port, issued))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def tcp_receiver(port_queue, num_transfers: int, cert_dir: str | None = None) -> None:
    from kv_transfer.buffer_pool import KvBufferPool
    from kv_transfer.tcp_transport import TcpKvReceiver

    async def main():
        # As in a decode worker: the cache is copied into the batch, then its buffer is reused.
        tokens, issued = bench_tokens(num_transfers)
        rx = TcpKvReceiver(KvSink(lambda kv: kv.release(), lambda *a: None, tokens, pool=KvBufferPool()),
                           timeout_s=600, tls=tls_link(cert_dir, "server"))
        port_queue.put((await rx.start("127.0.0.1", 0), issued))
        await asyncio.Event().wait()

    asyncio.run(main())


def recv_exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:  # an SSL socket takes no MSG_WAITALL
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def socket_receiver(port_queue, keep: bool, cert_dir: str | None = None) -> None:
    """Reads the bytes into one reused 4 MiB scratch buffer, or (keep) into a reused full-size
    buffer, as any receiver that keeps the cache must; both reuse memory, so no page faults."""
    srv = socket.create_server(("127.0.0.1", 0))
    port_queue.put(srv.getsockname()[1])
    tls = tls_link(cert_dir, "server")
    scratch = memoryview(bytearray(4 * 2**20))
    stores: dict[int, memoryview] = {}
    while True:
        conn, _ = srv.accept()
        if tls is not None:
            conn = tls.ssl_context().wrap_socket(conn, server_side=True)
        with conn:
            total = int.from_bytes(recv_exactly(conn, 8), "little")
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


def send_socket(port: int, payload: list[memoryview], tls=None) -> float:
    total = sum(len(p) for p in payload)
    start = time.perf_counter()
    conn = socket.create_connection(("127.0.0.1", port))
    if tls is not None:
        conn = tls.ssl_context().wrap_socket(conn, server_hostname="127.0.0.1")
    with conn:
        conn.sendall(total.to_bytes(8, "little"))
        for part in payload:
            conn.sendall(part)
        assert int.from_bytes(recv_exactly(conn, 8), "little") == total
    return time.perf_counter() - start


async def send_tcp(address: str, kv: TransferredKv, tls=None) -> float:
    from kv_transfer.tcp_transport import TcpKvSender

    start = time.perf_counter()
    await TcpKvSender(tls=tls).send(address, kv)
    return time.perf_counter() - start


async def send_grpc(address: str, kv: TransferredKv, tls=None) -> float:
    from kv_transfer.grpc_transport import GrpcKvSender

    sender = GrpcKvSender(timeout_s=600, tls=tls)
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
    parser.add_argument("--no-tls", action="store_true", help="skip the mutual-TLS transfers and their table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cert_dir = None
        if not args.no_tls:
            from security.certificates import ensure_local_certificates

            cert_dir = str(ensure_local_certificates(tmp))
        run(args, cert_dir)


def run(args, cert_dir: str | None) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    num_transfers = len(args.sizes_mb) * args.repeats
    receivers = {}  # each TLS path right after its plaintext one
    for name, target, fixed in (("scratch", socket_receiver, (False,)), ("keep", socket_receiver, (True,)),
                                ("tcp", tcp_receiver, (num_transfers,)), ("grpc", grpc_receiver, (num_transfers,))):
        receivers[name] = (target, fixed)
        if cert_dir is not None and name != "scratch":
            receivers[f"{name} tls"] = (target, (*fixed, cert_dir))
    procs, ports = [], {}
    for name, (target, fixed) in receivers.items():
        procs.append(ctx.Process(target=target, args=(q, *fixed), daemon=True))
        procs[-1].start()
        ports[name] = q.get()
    client_tls = tls_link(cert_dir, "client")
    grpc_client_tls = tls_link(cert_dir, "client", "tls_config.worker_grpc")
    transfers = iter(range(num_transfers))

    rows = []
    for size in args.sizes_mb:
        kv = make_kv(size, "bench")
        nbytes = kv.num_bytes
        raw = [memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()) for k, v in kv.layers for t in (k, v)]
        times = {name: [] for name in receivers}
        for _ in range(args.repeats):
            i = next(transfers)
            # Interleaved, so plaintext and TLS see the same state of the machine.
            for name in receivers:
                tls = name.endswith(" tls")
                if name.startswith(("scratch", "keep")):
                    times[name].append(send_socket(ports[name], raw, client_tls if tls else None))
                    continue
                port, tokens = ports[name]
                one = dataclasses.replace(kv, request_id=f"bench-{i}", transfer_token=tokens[i])
                if name.startswith("tcp"):
                    times[name].append(asyncio.run(send_tcp(f"127.0.0.1:{port}", one, client_tls if tls else None)))
                else:
                    times[name].append(asyncio.run(send_grpc(f"127.0.0.1:{port}", one,
                                                             grpc_client_tls if tls else None)))
        rows.append((nbytes, {name: nbytes / statistics.median(t) for name, t in times.items()}))
        print(f"{size} MiB done", file=sys.stderr)

    gb = 1e9
    print("| KV cache | socket, 4 MiB scratch | socket, kept (baseline) | pdserve TCP (default) | vs kept "
          "| vs scratch | pdserve gRPC PushKv | vs kept |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for nbytes, bps in rows:
        scratch, keep, tcp, grpc_bps = (bps[k] for k in ("scratch", "keep", "tcp", "grpc"))
        print(f"| {nbytes / 2**20:.0f} MiB | {scratch / gb:.2f} GB/s | {keep / gb:.2f} GB/s | {tcp / gb:.2f} GB/s | "
              f"{tcp / keep:.2f}x | {tcp / scratch:.2f}x | {grpc_bps / gb:.2f} GB/s | {grpc_bps / keep:.2f}x |")
    if cert_dir is not None:
        print("\nMutual TLS, same run (x = vs the same path in plaintext; pdserve TCP also vs the TLS socket, "
              "gRPC also vs plaintext pdserve TCP):\n")
        print("| KV cache | socket, kept, TLS | vs plaintext | pdserve TCP, TLS | vs plaintext TCP | vs TLS socket "
              "| pdserve gRPC PushKv, TLS | vs plaintext gRPC | vs plaintext TCP |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for nbytes, bps in rows:
            print(f"| {nbytes / 2**20:.0f} MiB | {bps['keep tls'] / gb:.2f} GB/s "
                  f"| {bps['keep tls'] / bps['keep']:.2f}x "
                  f"| {bps['tcp tls'] / gb:.2f} GB/s | {bps['tcp tls'] / bps['tcp']:.2f}x "
                  f"| {bps['tcp tls'] / bps['keep tls']:.2f}x "
                  f"| {bps['grpc tls'] / gb:.2f} GB/s | {bps['grpc tls'] / bps['grpc']:.2f}x "
                  f"| {bps['grpc tls'] / bps['tcp']:.2f}x |")
    for p in procs:
        p.terminate()


if __name__ == "__main__":
    main()
