"""`pdserve up --speculative`: the worker command lines and the coordinator config it builds, and what it refuses
before anything starts (nothing is started here)."""

from __future__ import annotations

import json

import pytest

from coordinator.config import parse_config
from launcher import cli, vllm_serve
from launcher.cluster_security import ClusterSecurity
from launcher.local_cluster import ClusterOptions, _check_config, _cluster_config, _instance_lists, _workers


@pytest.fixture
def security(tmp_path) -> ClusterSecurity:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    return ClusterSecurity.prepare(run_dir, None, None)


@pytest.fixture
def vllm_venv(tmp_path):
    """A vLLM environment as far as the launcher looks: its Python (never run here)."""
    venv = tmp_path / "vllm-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    return venv


def worker_argvs(options: ClusterOptions, security: ClusterSecurity) -> dict[str, list[str]]:
    return {child.name: child.argv for child, _ in _workers(options, ["pdserve"], "/m", security)}


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_decode_workers_get_the_speculative_flags_and_prefill_workers_none(security):
    argvs = worker_argvs(ClusterOptions(num_prefill=2, num_decode=2, speculative="suffix",
                                        num_speculative_tokens=3), security)
    for name, argv in argvs.items():
        if name.startswith("decode"):
            assert flag(argv, "--speculative-method") == "suffix" and flag(argv, "--num-speculative-tokens") == "3"
        else:
            assert "--speculative-method" not in argv and "--num-speculative-tokens" not in argv
    assert sum(name.startswith("decode") for name in argvs) == 2


def test_the_draft_count_is_left_to_the_worker_unless_given_and_worker_args_come_after_to_override(security):
    argvs = worker_argvs(ClusterOptions(speculative="ngram", worker_args=("--prompt-lookup-max", "3")), security)
    decode = argvs["decode worker 0"]
    assert flag(decode, "--speculative-method") == "ngram" and "--num-speculative-tokens" not in decode
    assert decode.index("--speculative-method") < decode.index("--prompt-lookup-max")


def test_without_speculative_no_worker_drafts(security):
    assert not any("--speculative-method" in argv for argv in worker_argvs(ClusterOptions(), security).values())


def test_under_autoscale_every_worker_gets_the_flags_for_when_it_is_switched_to_decode():
    options = ClusterOptions(speculative="ngram", autoscale=True)
    assert options.speculative_flags("prefill") == options.speculative_flags("decode") == [
        "--speculative-method", "ngram"]


def test_suffix_turns_the_coordinators_draft_corpus_on_over_a_config_that_has_it_off(tmp_path, security):
    config = tmp_path / "ms_coordinator.json"
    config.write_text(json.dumps({"speculative_config": {"enabled": False, "max_hints": 2}}))
    built = _cluster_config(ClusterOptions(config=str(config), speculative="suffix"), [], [], "/m", security)
    assert built["speculative_config"]["enabled"] and built["speculative_config"]["max_hints"] == 2
    parse_config(built)
    ngram = _cluster_config(ClusterOptions(config=str(config), speculative="ngram"), [], [], "/m", security)
    assert not ngram["speculative_config"]["enabled"]  # ngram drafts from the request alone: no hints to send
    plain = _cluster_config(ClusterOptions(config=str(config)), [], [], "/m", security)
    assert not plain["speculative_config"]["enabled"]


def test_vllm_decode_instances_get_vllms_speculative_config_and_say_so_in_their_entries(security, vllm_venv):
    options = ClusterOptions(engine="vllm", vllm_venv=str(vllm_venv), speculative="ngram", num_speculative_tokens=4)
    workers = _workers(options, ["pdserve"], "/m", security)
    for child, entry in workers:
        args = vllm_serve.parse_args(child.argv[2:])
        command = vllm_serve.serve_command(args)
        if args.role == "decode":
            assert json.loads(flag(command, "--speculative-config")) == {
                "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
            assert entry["speculative"] == "ngram"
        else:
            assert "--speculative-config" not in command and "speculative" not in entry
    prefill, decode = _instance_lists(workers)
    built = _cluster_config(options, prefill, decode, "/m", security)
    assert not built.get("speculative_config", {}).get("enabled")  # vLLM instances take no draft hints
    _check_config(built)  # the coordinator takes the entries as they are


@pytest.mark.parametrize("flags,message", [
    (["--num-speculative-tokens", "4"], "--num-speculative-tokens goes with --speculative"),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens 0: must be in [1, 32]"),
])
def test_up_refuses_speculative_flags_it_cannot_honour_naming_them(flags, message, capsys):
    assert cli.main(["up", *flags]) == 2
    assert message in capsys.readouterr().err


def test_up_refuses_vllm_suffix_decoding_by_name_where_the_vllm_environment_lacks_arctic_inference(vllm_venv, capsys):
    assert cli.main(["up", "--engine", "vllm", "--vllm-venv", str(vllm_venv), "--speculative", "suffix"]) == 2
    err = capsys.readouterr().err
    assert "--speculative suffix with --engine vllm" in err and "arctic-inference" in err


def test_a_config_the_coordinator_would_refuse_stops_up_before_anything_starts():
    with pytest.raises(ValueError, match="the coordinator would refuse its config"):
        _check_config({"instances": {"decode": [{"engine": "vllm", "url": "http://127.0.0.1:1", "speculative": "eagle"}]}})
