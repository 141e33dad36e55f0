"""The torch-free KV path: the transports import without torch, and raw-byte layers arrive exact."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kv_transfer.codec import KvAssembler
from kv_transfer.tcp_transport import TcpKvReceiver, TcpKvSender
from kv_transfer.wire import RawKvLayer, header, make_trailer
from kv_transfer.sink import KvSink
from kv_transfer.transfer_tokens import KvTransferTokens
from tests.helpers import REPO


@pytest.mark.system
def test_transports_import_without_torch():
    code = ("import sys, kv_transfer.wire, kv_transfer.tcp_transport, kv_transfer.grpc_transport; "
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("chunk_bytes", [100, 4096])
async def test_raw_byte_layers_arrive_as_the_tensors_they_encode(chunk_bytes):
    g = torch.Generator().manual_seed(3)
    tensors = [(torch.randn(9, 2, 8, generator=g).half(), torch.randn(9, 2, 8, generator=g).half())
               for _ in range(3)]
    received, failures, tokens = [], [], KvTransferTokens()
    rx = TcpKvReceiver(KvSink(received.append, lambda rid, msg: failures.append(msg), tokens), timeout_s=5)
    port = await rx.start("127.0.0.1", 0)

    async def items():
        yield header("raw-1", "float16", 3, (9, 2, 8), tokens.issue("raw-1"))
        for i, (k, v) in enumerate(tensors):
            yield RawKvLayer(i, memoryview(k.numpy().tobytes()), memoryview(v.numpy().tobytes()))
        yield make_trailer(7, 2.5)

    try:
        sent = await TcpKvSender(chunk_bytes=chunk_bytes).send_items(f"127.0.0.1:{port}", items())
    finally:
        await rx.stop()
    assert failures == [] and sent == 3 * 2 * 2 * 9 * 8 * 2
    (kv,) = received
    assert kv.first_token_id == 7 and kv.seq_len == 9
    for (k0, v0), (k1, v1) in zip(tensors, kv.layers):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_assembler_refuses_what_the_verifier_refuses():
    bad = header("r", "float32", 2, (3, 2, 4))
    bad.tensor_bytes += 4
    with pytest.raises(Exception, match="shape implies 96"):
        KvAssembler(bad)
