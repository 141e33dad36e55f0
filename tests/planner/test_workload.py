"""Workload input: traces and synthetic descriptions, and errors that name the line or field and the range."""

from __future__ import annotations

import pytest

from planner.workload import (
    LengthDistribution,
    SyntheticWorkload,
    WorkloadError,
    load_trace,
    write_trace,
)


def test_synthetic_workload_is_reproducible_from_its_seed_and_within_its_lengths():
    spec = "rate=20,count=300,prompt=uniform:10:50,output=normal:30:5,seed=7"
    first, again = SyntheticWorkload.parse(spec).generate(), SyntheticWorkload.parse(spec).generate()
    assert first == again != SyntheticWorkload.parse(spec.replace("seed=7", "seed=8")).generate()
    assert len(first.requests) == 300
    assert all(10 <= r.prompt_tokens <= 50 and r.output_tokens >= 1 for r in first.requests)
    assert 300 / 20 * 0.8 < first.span_s < 300 / 20 * 1.2  # Poisson arrivals at about the rate


def test_uniform_arrivals_span_exactly_count_over_rate():
    workload = SyntheticWorkload.parse("rate=4,duration=5,prompt=8,output=2,arrivals=uniform").generate()
    assert len(workload.requests) == 20 and workload.span_s == pytest.approx(5)
    assert [r.arrival_s for r in workload.requests[:3]] == [0, 0.25, 0.5]


@pytest.mark.parametrize("spec, message", [
    ("rate=0,count=5,prompt=8,output=2", r"rate: .*greater than 0 \(allowed: \(0, 100000\], got '0'\)"),
    ("rate=1,count=5,prompt=8", r"output: Field required"),
    ("rate=1,count=5,prompt=uniform:9:3,output=2", r"prompt: uniform needs low <= high, got low=9 high=3"),
    ("rate=1,count=5,prompt=zipf:3,output=2", r"prompt: 'zipf:3' is not N, uniform:LO:HI or normal:MEAN:STD"),
    ("rate=1,count=5,prompt=8,output=2,burst=3", r"burst: Extra inputs are not permitted"),
    ("rate=1,count=5,duration=3,prompt=8,output=2", r"count or duration, not both"),
])
def test_bad_synthetic_description_names_the_field(spec, message):
    with pytest.raises(WorkloadError, match=message):
        SyntheticWorkload.parse(spec)


def test_trace_round_trips_and_is_read_in_arrival_order(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"arrival_s": 2, "prompt_tokens": 5, "output_tokens": 3}\n\n'
                    '{"arrival_s": 0.5, "prompt_tokens": 7, "output_tokens": 1}\n')
    workload = load_trace(path)
    assert [r.arrival_s for r in workload.requests] == [0.5, 2]
    write_trace(workload, tmp_path / "again.jsonl")
    assert load_trace(tmp_path / "again.jsonl") == workload


@pytest.mark.parametrize("line, message", [
    ('{"arrival_s": -1, "prompt_tokens": 5, "output_tokens": 3}', r"line 2: arrival_s: .*greater than or equal to 0"),
    ('{"arrival_s": 1, "prompt_tokens": 0, "output_tokens": 3}', r"line 2: prompt_tokens: .*\(allowed: \[1, 1000000\]"),
    ('{"arrival_s": 1, "prompt_tokens": 5}', r"line 2: output_tokens: Field required"),
    ('arrival_s=1', r"line 2: not a JSON object"),
])
def test_bad_trace_line_names_its_line_and_field(tmp_path, line, message):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 3}\n' + line + "\n")
    with pytest.raises(WorkloadError, match=message):
        load_trace(path)


def test_normal_lengths_are_never_below_one_token():
    import random

    short = LengthDistribution.parse("normal:2:10")
    assert min(short.sample(random.Random(i)) for i in range(200)) == 1
