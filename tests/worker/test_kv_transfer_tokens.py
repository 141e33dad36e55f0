"""One-time KV transfer tokens with real workers: a KV stream from anyone but the prefill worker handed
the decode worker's token is refused, and the genuine request completes exactly as without it."""

from __future__ import annotations

import uuid

import grpc
import pytest

from kv_transfer.base import KvTransferError
from kv_transfer.codec import encode_kv
from kv_transfer.tcp_transport import TcpKvSender
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from tests.helpers import fake_prompt_kv, metrics_url, open_decode_by_hand, scrape, wait_for_idle

pytestmark = pytest.mark.system

PROMPT = "The coordinator sends the prompt"
MAX_TOKENS = 8
REFUSED = "refused: missing/invalid or already used transfer token"
REFUSALS = ("pdserve_worker_kv_streams_refused_total", ())
FAILURES = ("pdserve_kv_transfer_failures_total", ())


async def push_kv(cluster, transport: str, accepted: pb.Accepted, kv) -> None:
    """Push `kv` to the decode worker as a prefill worker would, over `transport`; raises if refused."""
    if transport == "tcp":
        await TcpKvSender().send(accepted.kv_data_address, kv)
        return
    async with grpc.aio.insecure_channel(cluster.decode.address) as channel:
        try:
            await pb_grpc.KvReceiverStub(channel).PushKv(iter(encode_kv(kv)), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise KvTransferError(f"{exc.code().name}: {exc.details()}") from exc


async def attacked_request(cluster, hf_model, transport: str, attack: bool) -> list[int]:
    """Play the coordinator for one greedy request over `transport`; with `attack`, forged and replayed KV
    streams hit the decode worker before and after the genuine one. Returns the request's token ids."""
    ids = hf_model[1](PROMPT)["input_ids"]
    rid = uuid.uuid4().hex
    sampling = pb.SamplingParams(temperature=0, top_p=1, max_tokens=MAX_TOKENS, ignore_eos=True)
    forged = fake_prompt_kv(rid, hf_model, len(ids))
    async with grpc.aio.insecure_channel(cluster.decode.address) as dch, \
            grpc.aio.insecure_channel(cluster.prefill.address) as pch:
        call = pb_grpc.DecodeServiceStub(dch).Decode(pb.DecodeRequest(
            request_id=rid, prompt_len=len(ids), max_seq_len=512, sampling=sampling), timeout=30)
        accepted = (await call.read()).accepted
        assert accepted.kv_transfer_token and accepted.kv_data_address
        if attack:  # a stream naming the genuine request, in flight and waiting for its KV
            for token in ("", "forged-" + accepted.kv_transfer_token[7:]):
                forged.transfer_token = token
                with pytest.raises(KvTransferError, match=REFUSED):
                    await push_kv(cluster, transport, accepted, forged)
        await pb_grpc.PrefillServiceStub(pch).Prefill(pb.PrefillRequest(
            request_id=rid, prompt_token_ids=ids, sampling=sampling, decode_address=cluster.decode.address,
            kv_data_address=accepted.kv_data_address if transport == "tcp" else "",
            kv_transfer_token=accepted.kv_transfer_token, kv_layout_version=accepted.kv_layout_version), timeout=30)
        if attack:  # the genuine token, seen on the wire and replayed: spent
            forged.transfer_token = accepted.kv_transfer_token
            with pytest.raises(KvTransferError, match=REFUSED):
                await push_kv(cluster, transport, accepted, forged)
        tokens = []
        while (event := await call.read()) is not grpc.aio.EOF:
            tokens.append(event.token.token_id)
    return tokens


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
async def test_kv_stream_with_a_wrong_token_is_refused_and_the_genuine_request_is_unaffected(
        cluster, hf_model, transport):
    url = metrics_url(cluster.decode)
    before = scrape(url)
    undisturbed = await attacked_request(cluster, hf_model, transport, attack=False)
    attacked = await attacked_request(cluster, hf_model, transport, attack=True)
    assert len(undisturbed) == MAX_TOKENS and attacked == undisturbed
    after = scrape(url)
    assert after[REFUSALS] - before.get(REFUSALS, 0) == 3  # no token, a forged one, a replayed one
    assert after[FAILURES] == before.get(FAILURES, 0)  # no request was failed for them
    wait_for_idle(cluster.decode.address, "decode")
    wait_for_idle(cluster.prefill.address, "prefill")


async def test_token_of_an_ended_request_is_refused(cluster, hf_model):
    rid = uuid.uuid4().hex
    async with grpc.aio.insecure_channel(cluster.decode.address) as channel:
        call = open_decode_by_hand(channel, rid)
        accepted = (await call.read()).accepted
        call.cancel()
        wait_for_idle(cluster.decode.address, "decode")  # the request is gone, and its token with it
        kv = fake_prompt_kv(rid, hf_model, 9)
        kv.transfer_token = accepted.kv_transfer_token
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.KvReceiverStub(channel).PushKv(iter(encode_kv(kv)), timeout=10)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and REFUSED in err.value.details()
