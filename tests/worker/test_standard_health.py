"""grpc.health.v1 on real worker processes, as Kubernetes' gRPC probes ask it: SERVING once ready on "" and each
pdserve service, NOT_SERVING from SIGTERM while the worker drains (and, with a coordinator, until it accepted the registration), no
worker secret needed, and a plaintext --health-port when TLS guards the gRPC port."""

from __future__ import annotations

import json
import signal
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from tests.certificates import make_pki
from tests.helpers import (ServerProcess, health, start_coordinator, start_sim_worker, start_worker, wait_for,
                           write_config)

pytestmark = pytest.mark.system

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
NAMES = {"prefill": ("", "pdserve.v1.PrefillService"),
         "decode": ("", "pdserve.v1.DecodeService", "pdserve.v1.KvReceiver")}


def check(address: str, service: str = "") -> int:
    """A probe's call: no metadata, no TLS."""
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=5).status


def health_address(worker: ServerProcess) -> str:
    """The --health-port address a worker printed before its ready line."""
    line = next(line for line in worker.output if line.startswith("pdserve worker health:"))
    return line.strip().rsplit(" ", 1)[-1]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_ready_simulated_worker_is_serving_on_the_server_and_each_of_its_services(role):
    worker = start_sim_worker(role)
    try:
        assert {name: check(worker.address, name) for name in NAMES[role]} == dict.fromkeys(NAMES[role], SERVING)
        with pytest.raises(grpc.RpcError) as unknown:
            check(worker.address, "pdserve.v1.NoSuchService")
        assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
    finally:
        worker.stop()


def test_a_real_model_worker_is_serving_once_ready(model_dir):
    worker = start_worker("decode", model_dir)
    try:
        assert [check(worker.address, name) for name in NAMES["decode"]] == [SERVING] * 3
    finally:
        worker.stop()


def test_a_worker_says_not_serving_from_sigterm_while_it_drains_its_requests():
    worker = start_sim_worker("decode", "--sim-decode-base-ms", "50", "--drain-seconds", "60", "--health-port", "0")
    with grpc.insecure_channel(worker.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert next(watch).status == SERVING
        decode = pb_grpc.DecodeServiceStub(channel).Decode(pb.DecodeRequest(
            request_id="long", prompt_len=4, prompt_token_ids=[1, 2, 3, 4], local_prefill=True, max_seq_len=4096,
            sampling=pb.SamplingParams(max_tokens=1000)), timeout=60)  # about 50 s of decoding
        next(event for event in decode if event.HasField("token"))  # decoding: one request in flight
        worker.proc.send_signal(signal.SIGTERM)
        assert next(watch).status == NOT_SERVING  # pushed to a watcher, as gRPC-aware balancers use it
        still = health(worker.address, "decode")
        assert still.draining and still.num_running == 1 and worker.proc.poll() is None
        assert [check(worker.address, name) for name in NAMES["decode"]] == [NOT_SERVING] * 3
        assert [check(health_address(worker), name) for name in NAMES["decode"]] == [NOT_SERVING] * 3
        decode.cancel()  # the last request ends: the drain is over
    assert worker.proc.wait(timeout=30) == 0


def test_probes_need_no_worker_secret_while_pdserve_calls_still_do(tmp_path):
    secret = tmp_path / "worker-secret"
    secret.write_text("a-secret-the-probe-does-not-know\n")
    worker = start_sim_worker("prefill", "--worker-secret-file", str(secret))
    try:
        assert check(worker.address) == SERVING
        with pytest.raises(grpc.RpcError) as refused:
            health(worker.address, "prefill")
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    finally:
        worker.stop()


def test_with_tls_on_the_grpc_port_probes_ask_the_plaintext_health_port_which_serves_nothing_else(tmp_path):
    pki = make_pki(tmp_path / "pki")
    workers = tmp_path / "workers.json"
    workers.write_text(json.dumps({"tls_config": {"worker_grpc": pki.link("server")}}))
    worker = start_sim_worker("decode", "--security-config", str(workers), "--health-port", "0")
    try:
        probe = health_address(worker)
        assert [check(probe, name) for name in NAMES["decode"]] == [SERVING] * 3
        with pytest.raises(grpc.RpcError) as plaintext_to_tls:
            check(worker.address)
        assert plaintext_to_tls.value.code() is grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as not_here:
            health(probe, "decode")
        assert not_here.value.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        worker.stop()


def test_a_worker_with_a_coordinator_says_serving_only_once_its_registration_is_accepted(model_dir, tmp_path):
    with socket.socket() as s:  # the coordinator's management port, chosen before it starts
        s.bind(("127.0.0.1", 0))
        manage_port = s.getsockname()[1]
    worker = start_sim_worker("decode", "--coordinator", f"http://127.0.0.1:{manage_port}",
                              "--heartbeat-interval", "0.2")
    coordinator = None
    try:
        with grpc.insecure_channel(worker.address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
            assert next(watch).status != SERVING  # ready, but no coordinator routes to it yet
            config = write_config(tmp_path / "ms_coordinator.json", [], [], model_dir, sections={
                "http_config": {"predict_ip": "127.0.0.1", "predict_port": 0, "manage_port": manage_port}})
            coordinator = start_coordinator(config)
            assert next(status for status in (r.status for r in watch) if status == SERVING) == SERVING
            watch.cancel()
    finally:
        if coordinator is not None:
            coordinator.stop()
        worker.stop()
