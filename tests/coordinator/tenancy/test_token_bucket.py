"""TokenBucket: refill to its capacity, debt paid back first, Retry-After from the shortfall."""

from __future__ import annotations

from coordinator.tenancy.token_bucket import TokenBucket


class Clock:
    def __init__(self):
        self.now = 50.0

    def __call__(self):
        return self.now


def test_a_bucket_holds_burst_seconds_of_its_rate_and_refills_to_it():
    clock = Clock()
    bucket = TokenBucket(per_minute=600, burst_s=6, clock=clock)  # 10 a second, 60 at most
    assert bucket.capacity == 60 and bucket.can_take(60)
    bucket.take(10)
    assert not bucket.can_take(51)
    bucket.take(50)
    assert not bucket.can_take(1)
    assert bucket.wait_s(25) == 3  # 25 short at 10 a second: 2.5 s, rounded up
    clock.now += 2.5
    assert bucket.can_take(25) and not bucket.can_take(26)
    clock.now += 1000
    assert bucket.refill() == 60  # never above its capacity


def test_an_amount_larger_than_the_bucket_passes_only_from_a_full_one_and_leaves_a_debt():
    clock = Clock()
    bucket = TokenBucket(per_minute=60, burst_s=10, clock=clock)  # 1 a second, 10 at most
    assert bucket.can_take(500)
    bucket.take(500)
    assert bucket.level == -490 and bucket.wait_s(1) == 491
    clock.now += 490
    assert not bucket.can_take(1)  # the debt is paid back first
    clock.now += 1
    assert bucket.can_take(1)
    bucket.give_back(1000)
    assert bucket.level == 10


def test_a_slow_bucket_still_holds_one_request():
    assert TokenBucket(per_minute=1, burst_s=6).capacity == 1.0
