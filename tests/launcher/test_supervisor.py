"""The supervisor's restart rules, without processes: backoff, its reset, how an exit is described."""

from __future__ import annotations

import signal

from launcher.supervisor import Backoff, RestartPolicy, describe_exit


def test_backoff_doubles_to_its_cap_and_starts_over_after_a_stable_run():
    backoff = Backoff(RestartPolicy(first_backoff_s=0.5, max_backoff_s=10.0, stable_after_s=30.0))
    assert [backoff.delay(uptime_s=1.0) for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff.delay(uptime_s=30.0) == 0.5  # up 30 s since its ready line: a new incident
    assert backoff.delay(uptime_s=0.0) == 1.0


def test_a_first_backoff_over_the_cap_is_kept():
    backoff = Backoff(RestartPolicy(first_backoff_s=20.0, max_backoff_s=10.0))
    assert [backoff.delay(uptime_s=0.0) for _ in range(3)] == [20.0, 20.0, 20.0]


def test_an_exit_is_described_by_its_code_or_its_signal():
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(-200) == "killed by signal 200"
