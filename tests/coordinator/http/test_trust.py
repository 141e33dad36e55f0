"""The coordinator's trust settings: a worker secret is only sent where registering takes proof."""

from __future__ import annotations

import pytest

from coordinator.config import ConfigError, parse_config
from coordinator.http.trust import CoordinatorTrust


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret"
    path.write_text("a-worker-secret-of-enough-length\n")
    return str(path)


def test_a_worker_secret_with_open_registration_refuses_to_start(secret):
    config = parse_config({"auth_config": {"worker_secret_file": secret}})
    with pytest.raises(ConfigError) as refused:
        CoordinatorTrust.from_config(config)
    assert "auth_config.worker_secret_file" in str(refused.value)
    assert "registration_token_file" in str(refused.value)


def test_a_worker_secret_with_a_registration_token_starts(secret):
    config = parse_config({"auth_config": {"worker_secret_file": secret, "registration_token_file": secret}})
    trust = CoordinatorTrust.from_config(config)
    assert trust.registration_needs_token and trust.worker_secret.matches("a-worker-secret-of-enough-length")
    assert not trust.worker_secret.matches("\udcff")  # undecodable header bytes compare, never raise
