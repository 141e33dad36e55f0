"""Slow and hostile clients against a real coordinator (simulated workers), played over raw sockets.

A client that trickles its request head is cut off by http_config.keepalive_timeout_s, one that
trickles its body gets a 408 in its API's format after body_timeout_s and gives its request slot
back, oversized heads get a 4xx, and a local media path is resolved (symlinks included) before the
multimodalInputsDir check. None of it gets a 5xx, and the server keeps serving meanwhile.
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.helpers import start_coordinator, start_sim_worker, write_config

pytestmark = pytest.mark.system

KEEPALIVE_S = 1.0
BODY_TIMEOUT_S = 1.0
SLACK_S = 2.5  # generous: these run beside other tests on a loaded machine
TRICKLE_EVERY_S = 0.3
CHAT = {"model": "pdserve-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hello there"}]}


class SlowClientCluster:
    """Simulated workers behind a coordinator with 1 s timeouts and one request slot; a media folder with links."""

    def __init__(self, model_dir, tmp):
        self.media = tmp / "media"
        self.media.mkdir()
        outside = tmp / "outside"
        outside.mkdir()
        (outside / "secret.png").write_bytes(b"\x89PNG not for clients")
        (self.media / "cat.png").write_bytes(b"\x89PNG a cat")
        os.symlink(self.media / "cat.png", self.media / "cat-link.png")
        os.symlink(outside / "secret.png", self.media / "escape.png")
        os.symlink("/etc/passwd", self.media / "passwd.png")
        os.symlink(outside, self.media / "outside-dir")
        os.symlink(self.media / "loop.png", self.media / "loop.png")
        self.prefill = start_sim_worker("prefill")
        self.decode = start_sim_worker("decode")
        http = {"predict_ip": "127.0.0.1", "predict_port": 0, "manage_port": 0,
                "keepalive_timeout_s": KEEPALIVE_S, "body_timeout_s": BODY_TIMEOUT_S}
        config = write_config(tmp / "ms_coordinator.json", [self.prefill.address], [self.decode.address], model_dir,
                              sections={"http_config": http, "request_limit": {"max_requests": 1}},
                              multimodalInputsDir=str(self.media))
        self.coordinator = start_coordinator(config)
        self.url = self.coordinator.address
        parts = urlsplit(self.url)
        self.host, self.port = parts.hostname, parts.port

    def connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=10)

    def chat(self, body: dict = CHAT) -> httpx.Response:
        # A fresh connection each time: the server closes idle ones after a second.
        return httpx.post(self.url + "/v1/chat/completions", json=body, timeout=30)

    def stop(self) -> list[int]:
        return [p.stop() for p in (self.coordinator, self.prefill, self.decode)]


@pytest.fixture(scope="module")
def slow(model_dir, tmp_path_factory):
    cluster = SlowClientCluster(model_dir, tmp_path_factory.mktemp("slow_clients"))
    yield cluster
    assert cluster.stop() == [0, 0, 0]


def recv_or_eof(sock: socket.socket, wait_s: float) -> bytes | None:
    """Bytes the server sent within `wait_s`; b"" once it has closed the connection; None if nothing came."""
    readable, _, _ = select.select([sock], [], [], wait_s)
    if not readable:
        return None
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""


def wait_for_close(sock: socket.socket, timeout_s: float) -> bytes:
    """Everything the server sent until it closed the connection; fails if it is still open after `timeout_s`."""
    received = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        data = recv_or_eof(sock, deadline - time.monotonic())
        if data == b"":
            return received
        received += data or b""
    raise AssertionError(f"connection still open after {timeout_s}s; received {received!r}")


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes] | None:
    """(status, headers, body) once `raw` holds a whole response with a Content-Length, else None."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    if len(body) < int(headers.get("content-length", 0)):
        return None
    return int(lines[0].split()[1]), headers, body


def exchange(slow: SlowClientCluster, raw_request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send `raw_request` at once on a new connection and read the one response."""
    with slow.connect() as sock:
        sock.sendall(raw_request)
        received = b""
        while (response := parse_response(received)) is None:
            data = recv_or_eof(sock, 10)
            assert data, f"no complete response; received {received!r}"
            received += data
        return response


def trickled_body_request(slow: SlowClientCluster, path: str, body: bytes, during=None):
    """Send complete headers, then `body` one byte per TRICKLE_EVERY_S until the server answers.

    Returns (status, headers, json body, seconds from the end of the headers to the answer, the result of
    `during()` called while the body was being trickled (again while it was served: the slot was not taken yet),
    the socket still open)."""
    sock = slow.connect()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: pdserve\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode())
    headers_sent = time.monotonic()
    received, seen_during, response = b"", None, None
    for i, byte in enumerate(body[:-1]):  # never the last byte: the body stays incomplete
        sock.sendall(bytes([byte]))
        if i == 1 and during is not None:
            # The server takes the slot once it has read the trickled head, which a loaded machine may not have done
            # yet: a request served before then is asked again, well before the body timeout frees the slot.
            seen_during = during()
            while seen_during.status_code == 200 and time.monotonic() < headers_sent + BODY_TIMEOUT_S / 2:
                seen_during = during()
        data = recv_or_eof(sock, TRICKLE_EVERY_S)
        assert data != b"", f"closed without an answer; received {received!r}"
        received += data or b""
        if (response := parse_response(received)) is not None:
            break
    answered_after = time.monotonic() - headers_sent
    assert response is not None, f"no answer while the body trickled for {answered_after:.1f}s"
    status, headers, payload = response
    return status, headers, json.loads(payload), answered_after, seen_during, sock


def test_client_trickling_its_headers_is_disconnected_after_keepalive_timeout_while_others_are_served(slow):
    sock = slow.connect()
    connected = time.monotonic()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: pdserve\r\nX-Slow: ")
    statuses = []  # a request served while the slow head is still arriving
    other = threading.Thread(target=lambda: statuses.append(slow.chat().status_code))
    other.start()
    received, closed_after = b"", None
    while time.monotonic() - connected < KEEPALIVE_S + SLACK_S:
        try:
            sock.sendall(b"a")
        except (BrokenPipeError, ConnectionResetError):
            closed_after = time.monotonic() - connected
            break
        data = recv_or_eof(sock, TRICKLE_EVERY_S)
        if data == b"":
            closed_after = time.monotonic() - connected
            break
        received += data or b""
    sock.close()
    other.join(30)
    assert closed_after is not None, f"a trickled head held its connection for {KEEPALIVE_S + SLACK_S}s"
    assert closed_after >= KEEPALIVE_S - 0.2, f"closed after {closed_after:.2f}s"
    assert received == b"", "nothing is answered to an incomplete request head"
    assert statuses == [200]
    assert slow.chat().status_code == 200


def test_connection_that_sends_nothing_is_closed_after_keepalive_timeout(slow):
    with slow.connect() as sock:
        connected = time.monotonic()
        assert wait_for_close(sock, KEEPALIVE_S + SLACK_S) == b""
        assert time.monotonic() - connected >= KEEPALIVE_S - 0.2, f"closed after {time.monotonic() - connected:.2f}s"


def test_idle_keep_alive_connection_is_closed_after_keepalive_timeout(slow):
    body = json.dumps(CHAT).encode()
    with slow.connect() as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: pdserve\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while (response := parse_response(received)) is None:
            received += recv_or_eof(sock, 10) or b""
        answered = time.monotonic()
        assert response[0] == 200
        assert wait_for_close(sock, KEEPALIVE_S + SLACK_S) == b""
        assert time.monotonic() - answered >= KEEPALIVE_S - 0.2


def test_trickled_chat_body_gets_openai_408_after_body_timeout_and_frees_its_request_slot(slow):
    body = json.dumps(CHAT).encode()
    status, headers, error, answered_after, during, sock = trickled_body_request(
        slow, "/v1/chat/completions", body, during=slow.chat)
    sock.close()
    assert status == 408
    assert headers["content-type"].startswith("application/json")
    message = f"request body not received within http_config.body_timeout_s={BODY_TIMEOUT_S:g}s"
    assert error == {"error": {"message": message, "type": "timeout_error", "param": None, "code": 408},
                     "error_info": {"code": 408, "message": message}}
    assert BODY_TIMEOUT_S - 0.2 <= answered_after <= BODY_TIMEOUT_S + SLACK_S, f"answered after {answered_after:.2f}s"
    # With max_requests = 1 the trickling client holds the one slot while its body is read, at most
    # body_timeout_s: meanwhile others get 429 at once; right after its 408 the slot is free again.
    assert during.status_code == 429 and during.headers["retry-after"] == "1", during.text
    assert slow.chat().status_code == 200


def test_trickled_generate_body_gets_tgi_408_after_body_timeout(slow):
    body = json.dumps({"inputs": "Hello there", "parameters": {"max_new_tokens": 2}}).encode()
    status, _, error, answered_after, _, sock = trickled_body_request(slow, "/generate", body)
    sock.close()
    assert status == 408
    assert error == {"error": f"request body not received within http_config.body_timeout_s={BODY_TIMEOUT_S:g}s",
                     "error_type": "timeout_error"}
    assert BODY_TIMEOUT_S - 0.2 <= answered_after <= BODY_TIMEOUT_S + SLACK_S, f"answered after {answered_after:.2f}s"
    assert httpx.post(slow.url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}},
                      timeout=30).status_code == 200


def test_trickled_body_connection_is_closed_soon_after_its_408(slow):
    body = json.dumps(CHAT).encode() + b" " * 200
    *_, sock = trickled_body_request(slow, "/v1/chat/completions", body)
    # aiohttp reads (and drops) the rest of the body for up to its lingering time, then closes.
    answered = time.monotonic()
    closed_after = None
    with sock:
        while time.monotonic() - answered < 15:
            try:
                sock.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                closed_after = time.monotonic() - answered
                break
            if recv_or_eof(sock, TRICKLE_EVERY_S) == b"":
                closed_after = time.monotonic() - answered
                break
    assert closed_after is not None and closed_after <= 10 + SLACK_S, f"closed after {closed_after}s"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generate"])
@pytest.mark.parametrize("head", [
    pytest.param(b"X-Big: " + b"a" * 20_000 + b"\r\n", id="20KB-header-value"),
    pytest.param(b"".join(b"X-Header-%d: v\r\n" % i for i in range(300)), id="300-headers"),
    pytest.param(b"X-" + b"n" * 10_000 + b": v\r\n", id="10KB-header-name"),
])
def test_oversized_request_head_gets_4xx_and_the_server_keeps_serving(slow, path, head):
    body = json.dumps(CHAT).encode()
    status, _, raw = exchange(slow, f"POST {path} HTTP/1.1\r\nHost: pdserve\r\n".encode() + head
                              + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert 400 <= status < 500
    error = json.loads(raw)["error"]  # the API's own format, not aiohttp's plain text
    assert "bad HTTP request" in (error["message"] if path.startswith("/v1/") else error)
    assert slow.chat().status_code == 200


def test_oversized_request_line_gets_4xx(slow):
    status, _, raw = exchange(slow, b"GET /v1/" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: pdserve\r\n\r\n")
    assert 400 <= status < 500 and "bad HTTP request" in json.dumps(json.loads(raw))
    assert slow.chat().status_code == 200


def chat_with_image(slow: SlowClientCluster, ref: str) -> httpx.Response:
    return slow.chat({**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": ref}}]}]})


@pytest.mark.parametrize("name", ["escape.png", "passwd.png", "outside-dir/secret.png", "../outside/secret.png"])
def test_media_path_leaving_multimodal_inputs_dir_through_a_symlink_or_dotdot_is_refused(slow, name):
    ref = f"{slow.media}/{name}"
    resp = chat_with_image(slow, ref)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["message"] == (f"messages.0.content.1.image_url: local files must lie under {slow.media}/, "
                                f"got {ref!r}")
    assert error["param"] == "messages.0.content.1" and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("name", ["cat.png", "cat-link.png"])
def test_media_path_symlinked_within_multimodal_inputs_dir_passes_the_folder_check(slow, name):
    resp = chat_with_image(slow, f"{slow.media}/{name}")
    # Past the path checks, a text-only model refuses media, as for any file in the folder.
    assert resp.status_code == 400
    assert "text-only" in resp.json()["error"]["message"]


@pytest.mark.parametrize("name,needle", [
    ("loop.png", "cannot resolve local path"),
    ("nul\x00.png", "cannot resolve local path"),
    ("a" * 5000 + ".png", "no such file"),
    ("a/" * 3000 + "x.png", "no such file"),
    ("missing.png", "no such file"),
])
def test_unresolvable_media_path_gets_400_naming_the_field(slow, name, needle):
    resp = chat_with_image(slow, f"{slow.media}/{name}")
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["message"].startswith("messages.0.content.1.image_url: ") and needle in error["message"]
    assert error["param"] == "messages.0.content.1"
