"""`pdserve plan` and `pdserve profile` from the command line: output, and bad input as exit 2 naming the flag."""

from __future__ import annotations

import json
import re

import pytest

from launcher.cli import main
from tests.planner.helpers import profiles

SYNTHETIC = "rate=25,count=200,prompt=uniform:128:384,output=uniform:20:60,seed=3"


@pytest.fixture
def profile_files(tmp_path):
    prefill, decode = profiles()
    prefill.save(tmp_path / "p.json")
    decode.save(tmp_path / "d.json")
    return ["--prefill-profile", str(tmp_path / "p.json"), "--decode-profile", str(tmp_path / "d.json")]


def plan(profile_files, *args: str) -> int:
    return main(["plan", *profile_files, "--synthetic", SYNTHETIC, "--ttft-ms", "200", "--tpot-ms", "40", *args])


def test_plan_prints_a_table_of_the_recommendation_and_one_fewer(profile_files, capsys):
    assert plan(profile_files) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["cluster", "prefill", "decode", "goodput", "req/s", "p90", "TTFT", "ms", "p90",
                                "TPOT", "ms", "SLOs"]
    assert lines[1].startswith("recommended") and lines[1].endswith("met")
    assert any(line.startswith("one fewer decode") and line.endswith("missed") for line in lines)
    assert lines[-1].startswith("bottleneck: decode")


def test_plan_json_matches_the_table(profile_files, capsys):
    assert plan(profile_files, "--json") == 0
    body = json.loads(capsys.readouterr().out)
    assert body["slo_met"] and body["bottleneck"] == "decode" and body["decode"] >= 2
    assert body["one_fewer"]["decode"]["slo_met"] is False
    assert body["goodput_rps"] == pytest.approx(body["good_requests"] / body["span_s"], abs=1e-3)


def with_flags(argv: list[str], flags: list[str]) -> list[str]:
    """`argv` with each flag of `flags` (flag, value pairs) set: replaced where present, else added."""
    argv = list(argv)
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


@pytest.mark.parametrize("args, message", [
    (["--percentile", "0"], r"--percentile: .*\(allowed: \(0, 100\], got 0.0\)"),
    (["--ttft-ms", "-5"], r"--ttft-ms: .*greater than 0"),
    (["--max-running", "0"], r"--max-running: must be in \[1, 1000000\], got 0"),
    (["--block-size", "0"], r"--block-size: must be in \[1, 1000000\], got 0"),
    (["--synthetic", "rate=1,count=0,prompt=8,output=2"], r"--synthetic: count: .*\(allowed: \[1, 1000000\]"),
    (["--synthetic", "rate=1,duration=inf,prompt=8,output=2"], r"--synthetic: duration needs a finite number"),
])
def test_plan_bad_input_exits_2_naming_the_flag(profile_files, capsys, args, message):
    argv = with_flags(["plan", *profile_files, "--synthetic", SYNTHETIC, "--ttft-ms", "200", "--tpot-ms", "40"], args)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve plan: ") and "Traceback" not in err
    assert re.search(message, err), err


def test_plan_with_a_profile_of_the_wrong_role_names_the_flag(profile_files, capsys):
    swapped = [profile_files[0], profile_files[3], profile_files[2], profile_files[1]]
    assert plan(swapped) == 2
    assert "--prefill-profile: " in capsys.readouterr().err


def test_plan_whose_slo_no_cluster_meets_exits_1_saying_why(profile_files, capsys):
    assert plan(profile_files, "--tpot-ms", "5", "--max-instances", "3") == 1
    assert "miss p90 TPOT 5 ms" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--worker", "nohostport"], "--worker: expected HOST:PORT"),
    (["--batch-sizes", "1,x"], "--batch-sizes: expected whole numbers"),
    (["--decode-steps", "2"], "--decode-steps: must be in [4, 10000], got 2"),
    (["--out", "/nonexistent-folder/decode.json"], "--out: cannot write '/nonexistent-folder/decode.json'"),
])
def test_profile_bad_input_exits_2_before_calling_the_worker(capsys, args, message):
    argv = with_flags(["profile", "--worker", "127.0.0.1:1", "--role", "decode"], args)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_plan_with_a_workload_that_is_not_text_exits_2_naming_the_file(profile_files, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(b"\xff\xfe{}\n")
    argv = with_flags(["plan", *profile_files, "--workload", str(trace), "--ttft-ms", "200", "--tpot-ms", "40"], [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{trace}: not UTF-8 text" in err and "Traceback" not in err
