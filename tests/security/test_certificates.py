"""`pdserve up --tls DIR`'s certificates: a CA and two leaves that chain to it, keys private, kept across runs."""

from __future__ import annotations

import ssl

import pytest

from security.certificates import FILES, ensure_local_certificates


def test_the_folder_gets_a_ca_and_leaves_that_verify_and_private_keys(tmp_path):
    folder = ensure_local_certificates(tmp_path / "tls")
    assert all((folder / name).exists() for name in FILES)
    for leaf in ("server", "client"):
        assert (folder / f"{leaf}-key.pem").stat().st_mode & 0o777 == 0o600
        ctx = ssl.create_default_context(cafile=str(folder / "ca.pem"))
        ctx.load_cert_chain(str(folder / f"{leaf}.pem"), str(folder / f"{leaf}-key.pem"))  # key matches


def test_existing_files_are_kept_and_a_missing_pair_is_issued_by_the_same_ca(tmp_path):
    folder = ensure_local_certificates(tmp_path / "tls")
    ca, server = (folder / "ca.pem").read_bytes(), (folder / "server.pem").read_bytes()
    assert ensure_local_certificates(folder) == folder and (folder / "server.pem").read_bytes() == server
    (folder / "client.pem").unlink()
    ensure_local_certificates(folder)
    assert (folder / "ca.pem").read_bytes() == ca and (folder / "server.pem").read_bytes() == server
    assert (folder / "client.pem").exists()


def test_a_ca_without_its_key_cannot_complete_the_folder(tmp_path):
    folder = ensure_local_certificates(tmp_path / "tls")
    (folder / "ca-key.pem").unlink()
    (folder / "client.pem").unlink()
    with pytest.raises(ValueError, match="ca-key.pem"):
        ensure_local_certificates(folder)
