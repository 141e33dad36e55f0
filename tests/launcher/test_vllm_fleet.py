"""`pdserve up --engine vllm`'s instances: their `vllm serve` command lines, environment and fixes."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from launcher import vllm_serve
from launcher.vllm_fleet import plan_instances, speculative_config, speculative_refusal


def serve_args(*extra: str):
    return vllm_serve.build_parser().parse_args(["--role", "prefill", "--model", "/m", "--port", "8100",
                                                 "--side-channel-port", "5600", *extra])


def test_a_prefill_instance_is_a_nixl_producer_on_loopback_with_its_kv_events():
    command = vllm_serve.serve_command(serve_args("--kv-events", "ipc:///run/kv"))
    assert command[1:3] == ["serve", "/m"] and command[command.index("--host") + 1] == "127.0.0.1"
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert transfer == {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu", "kv_role": "kv_producer"}
    events = json.loads(command[command.index("--kv-events-config") + 1])
    assert events["endpoint"] == "ipc:///run/kv" and events["enable_kv_cache_events"] is True
    assert json.loads(command[command.index("--structured-outputs-config") + 1]) == {"backend": "guidance"}


def test_tls_asks_for_client_certificates_and_the_api_key_stays_off_the_command_line(tmp_path):
    key = tmp_path / "key"
    key.write_text("a-secret-of-enough-length\n")
    args = serve_args("--api-key-file", str(key), "--ssl-certfile", "s.pem", "--ssl-keyfile", "s-key.pem",
                      "--ssl-ca-certs", "ca.pem")
    command = vllm_serve.serve_command(args)
    assert command[command.index("--ssl-cert-reqs") + 1] == "2" and "--ssl-ca-certs" in command
    assert not any("a-secret" in part for part in command)
    env = vllm_serve.serve_environment(args)
    assert env["VLLM_API_KEY"] == "a-secret-of-enough-length"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1" and env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(vllm_serve.SITE)
    assert env["PDSERVE_VLLM_KEEP_AFFINITY"] == "1" and int(env["PDSERVE_NIXL_PTHR_DELAY_US"]) > 0


def test_vllms_info_lines_are_told_apart_from_warnings():
    assert vllm_serve.INFO.match("(EngineCore pid=5084) INFO 11-27 02:26:38 [core.py:1] ready")
    assert vllm_serve.INFO.match("INFO:     Started server process [3425]")
    assert not vllm_serve.INFO.match("(EngineCore pid=5084) WARNING 11-27 02:26:38 [base.py:214] x")


def test_instances_get_ports_of_their_own_and_local_kv_event_sockets(tmp_path):
    planned = plan_instances(1, 2, tmp_path)
    assert [i.role for i in planned] == ["prefill", "decode", "decode"]
    ports = [p for i in planned for p in (i.port, i.side_channel_port)]
    assert len(set(ports)) == len(ports)
    assert all(i.kv_events.startswith(f"ipc://{tmp_path}/") for i in planned)
    assert planned[1].entry("https") == {"engine": "vllm", "url": f"https://127.0.0.1:{planned[1].port}",
                                         "kv_events": planned[1].kv_events, "device": "cpu"}


def test_a_missing_vllm_environment_is_named(tmp_path):
    with pytest.raises(ValueError, match="make vllm-env"):
        plan_instances(1, 0, tmp_path)[0].argv(tmp_path / "no-venv", "/m")


def test_the_affinity_fix_skips_only_nixls_call(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: calls.append(cores))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setenv("PDSERVE_VLLM_KEEP_AFFINITY", "1")
    monkeypatch.delenv("PDSERVE_NIXL_PTHR_DELAY_US", raising=False)
    path = Path(vllm_serve.SITE) / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("vllm_site_under_test", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    exec("import os\nos.sched_setaffinity(0, {1})", {"__name__": "vllm.distributed.kv_transfer.nixl.base_worker"})
    os.sched_setaffinity(0, {0})
    assert calls == [{0}]


def test_a_decode_instance_passes_its_speculative_config_to_vllm_and_a_prefill_instance_refuses_one():
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    args = vllm_serve.parse_args(["--role", "decode", "--model", "/m", "--port", "8100", "--side-channel-port", "5600",
                                  "--speculative-config", config])
    command = vllm_serve.serve_command(args)
    assert command[command.index("--speculative-config") + 1] == config
    assert "--speculative-config" not in vllm_serve.serve_command(serve_args())
    with pytest.raises(SystemExit):
        vllm_serve.parse_args(["--role", "prefill", "--model", "/m", "--port", "8100", "--side-channel-port", "5600",
                               "--speculative-config", config])


def test_vllms_speculative_config_drafts_as_a_pdserve_decode_worker_does_by_default():
    assert speculative_config("ngram") == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5,
                                           "prompt_lookup_min": 2}
    assert speculative_config("suffix", 8) == {"method": "suffix", "num_speculative_tokens": 8}


def test_vllm_suffix_decoding_is_refused_by_name_until_arctic_inference_is_in_the_vllm_environment(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    assert speculative_refusal("ngram", tmp_path) == ""
    assert "arctic-inference" in speculative_refusal("suffix", tmp_path)
    built = tmp_path / "lib" / "python3.11" / "site-packages" / "arctic_inference" / "suffix_decoding"
    built.mkdir(parents=True)
    (built / "_C.cpython-311-x86_64-linux-gnu.so").touch()
    assert speculative_refusal("suffix", tmp_path) == ""
