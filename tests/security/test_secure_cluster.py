"""A cluster with mutual TLS on every link and a worker secret, driven by real clients over https.

One prefill and two decode workers: one takes KV over its raw-TCP port (TLS), the other over gRPC
PushKv (TLS), so both KV paths run encrypted; greedy output must equal the plaintext cluster's.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time

import grpc
import httpx
import openai
import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from tests.certificates import make_pki
from tests.helpers import ServerProcess, pdserve_argv, start_coordinator, start_worker, write_api_keys, write_config

pytestmark = pytest.mark.system

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Roses are red,"]


def write_json(path, data) -> str:
    path.write_text(json.dumps(data))
    return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure(pki, model_dir, tmp_path_factory):
    """Workers and a coordinator with mutual TLS on every link, a CRL on the predict port, a worker secret."""
    tmp = tmp_path_factory.mktemp("secure")
    secret = tmp / "worker-secret"
    secret.write_text("s3cret-for-the-test-cluster-only\n")
    workers = write_json(tmp / "workers.json", {
        "tls_config": {"worker_grpc": pki.link("server"), "kv_transfer": pki.link("server"),
                       "registration": pki.link("client")},
        "auth_config": {"worker_secret_file": str(secret)},
    })
    prefill = start_worker("prefill", model_dir, "--security-config", workers)
    decode_tcp = start_worker("decode", model_dir, "--security-config", workers)
    decode_grpc = start_worker("decode", model_dir, "--security-config", workers, "--kv-data-port", "-1")
    sections = {
        "tls_config": {"predict": pki.link("server", crl="crl.pem"), "management": pki.link("server"),
                       "worker_grpc": pki.link("client")},
        "auth_config": {"worker_secret_file": str(secret)},
    }
    config = write_config(tmp / "ms_coordinator.json", [prefill.address], [decode_tcp.address, decode_grpc.address],
                          model_dir, sections)
    coordinator = start_coordinator(config)
    yield type("Secure", (), dict(url=coordinator.address, coordinator=coordinator, prefill=prefill,
                                  decodes=[decode_tcp, decode_grpc], config=config, sections=sections, tmp=tmp,
                                  secret=secret.read_text().strip(), model_dir=model_dir))
    for proc in (coordinator, prefill, decode_tcp, decode_grpc):
        proc.stop()


def tls_client(pki, leaf="client") -> httpx.Client:
    return httpx.Client(verify=pki.client_context(leaf), timeout=60)


def greedy_chat(client: openai.OpenAI, prompt: str) -> str:
    reply = client.chat.completions.create(model="pdserve-tiny", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=12, temperature=0)
    return reply.choices[0].message.content


def test_openai_sdk_over_mutual_tls_gives_the_plaintext_clusters_greedy_output(secure, pki, cluster):
    assert secure.url.startswith("https://")
    over_tls = openai.OpenAI(base_url=secure.url + "/v1", api_key="unused", http_client=tls_client(pki))
    plain = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    # Round robin over both decode workers: the raw-TCP and the gRPC KV path each carry two of these.
    for prompt in PROMPTS:
        assert greedy_chat(over_tls, prompt) == greedy_chat(plain, prompt)
    with tls_client(pki) as http:
        instances = http.get(management(secure) + "/v1/instances").json()
    served = {i["address"]: i["served"] for i in instances["decode"]}
    assert len(served) == 2 and all(n >= 2 for n in served.values()), served


def management(secure) -> str:
    line = next(l for l in secure.coordinator.output if l.startswith("pdserve coordinator management:"))
    return line.strip().rsplit(" ", 1)[-1]


def test_curl_with_cacert_cert_and_key_as_in_seed_002(secure, pki):
    body = {"prompt": "My name is Olivier and I", "stream": True, "repetition_penalty": 1.0, "top_p": 1.0,
            "top_k": 10, "max_tokens": 16, "temperature": 1.0}
    out = subprocess.run(
        ["curl", "-sS", "-H", "Accept: application/json", "-H", "Content-type: application/json",
         "--cacert", pki.path("ca.pem"), "--cert", pki.path("client.pem"), "--key", pki.path("client-key.pem"),
         "-X", "POST", "-d", json.dumps(body), secure.url + "/generate"],
        capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    events = [json.loads(e) for e in out.stdout.split(b"\0") if e]
    assert len(events) >= 2 and all(isinstance(e["text"], list) for e in events)


def test_tgi_and_mindie_calls_over_https(secure, pki):
    with tls_client(pki) as http:
        tgi = http.post(secure.url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 5}})
        mindie = http.post(secure.url + "/infer", json={"inputs": "Hello", "stream": False,
                                                         "parameters": {"max_new_tokens": 5}})
    assert tgi.status_code == 200 and isinstance(tgi.json()["generated_text"], str)
    assert mindie.status_code == 200, mindie.text


@pytest.mark.parametrize("leaf", [None, "other-ca-client", "expired-client", "revoked-client"])
def test_clients_without_a_good_certificate_are_refused_and_it_keeps_serving(secure, pki, leaf):
    with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
        with tls_client(pki, leaf) as http:
            http.get(secure.url + "/v1/models")
    with tls_client(pki) as http:
        assert http.get(secure.url + "/v1/models").status_code == 200


def test_plain_http_to_the_tls_port_is_a_clear_400(secure):
    resp = httpx.post(secure.url.replace("https://", "http://") + "/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 400 and "https://" in resp.json()["error"]["message"]


def test_a_direct_grpc_call_needs_a_client_certificate_and_the_worker_secret(secure, pki):
    read = lambda name: (pki.dir / name).read_bytes()  # noqa: E731
    with_cert = grpc.ssl_channel_credentials(read("ca.pem"), read("client-key.pem"), read("client.pem"))
    with grpc.secure_channel(secure.prefill.address, with_cert) as channel:
        stub = pb_grpc.PrefillServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Health(pb.HealthRequest(), timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED and "worker secret" in refused.value.details()
        reply = stub.Health(pb.HealthRequest(), timeout=10, metadata=[("authorization", f"Bearer {secure.secret}")])
        assert reply.role == "prefill"
    without_cert = grpc.ssl_channel_credentials(read("ca.pem"))
    with grpc.secure_channel(secure.prefill.address, without_cert) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.PrefillServiceStub(channel).Health(
                pb.HealthRequest(), timeout=10, metadata=[("authorization", f"Bearer {secure.secret}")])
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


def test_a_peer_pull_needs_the_worker_secret_and_then_streams_over_mutual_tls(secure, pki):
    """KvPeer.PullKv carries KV out of a worker: the worker secret is asked of it as of any control call."""
    with tls_client(pki) as client:
        reply = client.post(secure.url + "/v1/completions", json={
            "model": "pdserve-tiny", "prompt": " ".join(PROMPTS * 6), "max_tokens": 2, "return_token_ids": True})
    ids = reply.json()["choices"][0]["prompt_token_ids"]
    wanted = (len(ids) - 1) // 16 * 16  # the prefill worker's cached leading blocks
    read = lambda name: (pki.dir / name).read_bytes()  # noqa: E731
    creds = grpc.ssl_channel_credentials(read("ca.pem"), read("client-key.pem"), read("client.pem"))
    secret = [("authorization", f"Bearer {secure.secret}")]
    with grpc.secure_channel(secure.prefill.address, creds) as channel:
        stub = pb_grpc.KvPeerStub(channel)
        request = pb.PullKvRequest(request_id="t", token_ids=ids, max_tokens=wanted, block_size=16)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.PullKv(request, timeout=10))
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        messages = list(stub.PullKv(request, timeout=10, metadata=secret))
        assert messages[0].header.shape[0] == wanted and messages[-1].HasField("trailer")
        nobody = pb.PullKvRequest(token_ids=[7] * 64, max_tokens=64, block_size=16)
        with pytest.raises(grpc.RpcError) as absent:  # a prompt it does not hold: an answer, not a refusal
            list(stub.PullKv(nobody, timeout=10, metadata=secret))
        assert absent.value.code() is grpc.StatusCode.NOT_FOUND


def served_common_name(url: str, pki) -> str:
    host, port = url.removeprefix("https://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with pki.client_context().wrap_socket(raw, server_hostname=host) as tls:
            der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value


def test_sighup_serves_a_new_certificate_key_and_api_keys_without_a_restart(secure, pki):
    cert, key = secure.tmp / "live.pem", secure.tmp / "live-key.pem"
    shutil.copy(pki.path("server.pem"), cert)
    shutil.copy(pki.path("server-key.pem"), key)
    keys = write_api_keys(secure.tmp / "api-keys", ["old-key"])
    sections = json.loads(json.dumps(secure.sections))
    sections["tls_config"]["predict"].update(tls_cert=str(cert), tls_key=str(key))
    sections["auth_config"]["api_keys_file"] = str(keys)
    config = json.loads(secure.config.read_text())
    config.update(sections)
    coordinator = start_coordinator(write_json(secure.tmp / "reloading.json", config))
    try:
        assert served_common_name(coordinator.address, pki) == "server"
        with tls_client(pki) as http:
            http.headers["Authorization"] = "Bearer old-key"
            stream = http.stream("POST", coordinator.address + "/v1/completions",
                                 json={"model": "pdserve-tiny", "prompt": "Once", "max_tokens": 60, "stream": True,
                                       "ignore_eos": True})
            response = stream.__enter__()  # a connection in flight across the reload
            shutil.copy(pki.path("server2.pem"), cert)
            shutil.copy(pki.path("server2-key.pem"), key)
            write_api_keys(keys, ["new-key"])
            coordinator.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while served_common_name(coordinator.address, pki) != "server-renewed":
                assert time.monotonic() < deadline, "the new certificate was not served after SIGHUP"
                time.sleep(0.2)
            assert b"[DONE]" in response.read()  # finished on the old one
            stream.__exit__(None, None, None)
        with tls_client(pki) as http:
            models = coordinator.address + "/v1/models"
            assert http.get(models, headers={"Authorization": "Bearer old-key"}).status_code == 401
            assert http.get(models, headers={"Authorization": "Bearer new-key"}).status_code == 200
    finally:
        coordinator.stop()


def test_bad_tls_files_fail_start_up_naming_the_key_and_the_file(secure, pki, model_dir):
    config = json.loads(secure.config.read_text())
    config.update(json.loads(json.dumps(secure.sections)))
    config["tls_config"]["predict"]["tls_key"] = pki.path("client-key.pem")
    with pytest.raises(RuntimeError) as failed:
        start_coordinator(write_json(secure.tmp / "bad.json", config))
    assert "tls_config.predict.tls_key" in str(failed.value) and "client-key.pem" in str(failed.value)

    worker_file = write_json(secure.tmp / "bad-worker.json", {"tls_config": {"worker_grpc": pki.link(
        "server", tls_key=pki.path("server-key-encrypted.pem"), tls_passwd=pki.path("wrong-password"))}})
    with pytest.raises(RuntimeError) as failed:
        ServerProcess(pdserve_argv("worker", "--role", "decode", "--simulate", "--security-config", worker_file),
                      "pdserve worker ready:")
    assert "tls_config.worker_grpc.tls_passwd" in str(failed.value) and "wrong-password" in str(failed.value)
