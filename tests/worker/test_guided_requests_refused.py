"""Through the real servicers (in-process gRPC): what a worker cannot honour is INVALID_ARGUMENT, checked off the loop."""

from __future__ import annotations

import threading
import uuid

import grpc
import llguidance
import pytest

from kv_transfer.grpc_transport import GrpcKvSender
from kv_transfer.tcp_transport import TcpKvSender
from kv_transfer.transfer_tokens import KvTransferTokens
from kv_transfer.wire import KV_LAYOUT_VERSION
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from worker.engine.block_pool import BlockPool
from worker.torch_engine.build import paged_pool
from worker.torch_engine.decode_engine import DecodeEngine
from worker.torch_engine.model_runner import ModelRunner
from worker.torch_engine.prefill_engine import PrefillEngine
from worker.metrics import NULL_METRICS
from worker.service.drain import DrainGate
from worker.service.servicers import DecodeServicer, PrefillServicer
from worker.simulated.cost_model import CostModel, KvShape
from worker.simulated.decode_engine import SimulatedDecodeEngine
from worker.simulated.prefill_engine import SimulatedPrefillEngine

DIGITS = llguidance.LLMatcher.grammar_from_regex(r"[0-9]{1,3}")
PROMPT = [5, 6, 7, 8]


class InProcessWorker:
    """A prefill and a decode servicer over the given engines, on one in-process gRPC server."""

    def __init__(self, prefill, decode):
        self.prefill, self.decode = prefill, decode
        self.server = grpc.aio.server()
        gate = DrainGate()
        pb_grpc.add_PrefillServiceServicer_to_server(
            PrefillServicer(prefill, GrpcKvSender(), TcpKvSender(), 5.0, NULL_METRICS, gate), self.server)
        pb_grpc.add_DecodeServiceServicer_to_server(
            DecodeServicer(decode, "", KvTransferTokens(), NULL_METRICS, gate), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def refusal(self, stage: str, sampling: pb.SamplingParams) -> grpc.aio.AioRpcError:
        """The error a Prefill or Decode call with these sampling rules ends with."""
        async with grpc.aio.insecure_channel(self.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                if stage == "prefill":
                    await pb_grpc.PrefillServiceStub(channel).Prefill(pb.PrefillRequest(
                        request_id=uuid.uuid4().hex, prompt_token_ids=PROMPT, sampling=sampling,
                        decode_address="127.0.0.1:1", kv_layout_version=KV_LAYOUT_VERSION), timeout=10)
                else:
                    call = pb_grpc.DecodeServiceStub(channel).Decode(pb.DecodeRequest(
                        request_id=uuid.uuid4().hex, prompt_len=len(PROMPT), max_seq_len=64, sampling=sampling,
                        prompt_token_ids=PROMPT, local_prefill=True), timeout=10)
                    await call.read()
        return refused.value


@pytest.fixture(scope="module")
async def real_worker(model_dir):
    runner = ModelRunner(model_dir)
    worker = InProcessWorker(PrefillEngine(runner, paged_pool(runner, 1000)), DecodeEngine(runner, paged_pool(runner, 1000)))
    await worker.server.start()  # the engines never start: every request here is refused before them
    yield worker
    await worker.server.stop(0)


@pytest.fixture(scope="module")
async def simulated_worker():
    worker = InProcessWorker(SimulatedPrefillEngine(CostModel(), KvShape(), BlockPool(64, 16)),
                             SimulatedDecodeEngine(CostModel(), BlockPool(64, 16)))
    await worker.server.start()
    yield worker
    await worker.server.stop(0)


def guided(grammar: str, generated: list[int] = (), **fields) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=4, guided=pb.GuidedDecoding(grammar=grammar, generated_token_ids=generated),
                             **fields)


@pytest.mark.parametrize("stage", ["prefill", "decode"])
@pytest.mark.parametrize("sampling,details", [
    (guided("start: missing_rule"), "guided decoding: "),
    (guided(DIGITS, [40]), "guided decoding: the tokens generated so far do not follow the grammar"),
    (pb.SamplingParams(max_tokens=4, logit_bias={1224: 5.0}), "logit_bias names token id 1224, outside the model's"),
    (pb.SamplingParams(max_tokens=4, logit_bias={7: -101.0}), "logit_bias of token id 7 is -101.0"),
], ids=["grammar_does_not_compile", "replay_outside_grammar", "bias_outside_vocab", "bias_out_of_range"])
async def test_a_real_worker_refuses_what_it_cannot_honour_as_invalid_argument(real_worker, stage, sampling,
                                                                                details):
    refused = await real_worker.refusal(stage, sampling)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details().startswith(details)
    assert real_worker.decode.admission.budget.used == real_worker.prefill.admission.budget.used == 0


@pytest.mark.parametrize("stage", ["prefill", "decode"])
@pytest.mark.parametrize("sampling,details", [
    (guided(DIGITS), "guided decoding (guided) is not available on a simulated worker"),
    (pb.SamplingParams(max_tokens=4, logit_bias={7: 1.0}), "logit_bias is not available on a simulated worker"),
], ids=["guided", "logit_bias"])
async def test_a_simulated_worker_refuses_guided_decoding_and_logit_bias_naming_the_field(
        simulated_worker, stage, sampling, details):
    refused = await simulated_worker.refusal(stage, sampling)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details().startswith(details)


async def test_a_grammar_is_checked_on_a_thread_so_neither_the_event_loop_nor_the_engine_compiles_it(
        real_worker, monkeypatch):
    threads = []
    check = real_worker.decode.check_sampling

    def recording_check(sampling):
        threads.append(threading.current_thread())
        check(sampling)

    monkeypatch.setattr(real_worker.decode, "check_sampling", recording_check)
    grammar = llguidance.LLMatcher.grammar_from_regex(r"x{1,2}[0-9]+" + uuid.uuid4().hex)  # never compiled before
    refused = await real_worker.refusal("decode", guided(grammar, [5]))  # a compiled grammar, a bad replay
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert threads and threads[0] is not threading.main_thread()
    assert grammar in real_worker.decode.guidance.compiler._cache  # the engine will only copy it
