"""ApiKeyStore: the digests file format, the Authorization header forms, reload keeping good keys."""

from __future__ import annotations

import hashlib

import pytest

from security.api_keys import INVALID, MALFORMED, MISSING, ApiKeyFileError, ApiKeyStore, hash_key

KEY = "sk-pdserve-alice-0123456789"
OTHER_KEY = "sk-pdserve-bob-9876543210"


def write_keys(path, *lines: str):
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture
def store(tmp_path) -> ApiKeyStore:
    return ApiKeyStore.load(write_keys(tmp_path / "keys", "# team keys", "", hash_key(KEY) + "  # alice",
                                       hash_key(OTHER_KEY)))


def test_hash_key_is_the_sha256_hex_that_sha256sum_prints():
    assert hash_key(KEY) == hashlib.sha256(KEY.encode()).hexdigest()
    assert len(hash_key(KEY)) == 64 and hash_key(KEY) == hash_key(KEY).lower()


def test_comments_and_blank_lines_are_skipped(store):
    assert store.num_keys == 2


@pytest.mark.parametrize("header", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER  {KEY} ", KEY, f" {OTHER_KEY}",
                                    f"Bearer\t{OTHER_KEY}"])
def test_bearer_and_bare_keys_are_accepted(store, header):
    assert store.identify(header)[0] is None


@pytest.mark.parametrize("header,reason", [
    (None, MISSING), ("", MISSING), ("   ", MISSING),
    ("Bearer", MALFORMED), ("Bearer   ", MALFORMED), (f"Basic {KEY}", MALFORMED), (f"Bearer {KEY} extra", MALFORMED),
    ("Bearer wrong-key", INVALID), ("wrong-key", INVALID), (f"Bearer {KEY}x", INVALID), (hash_key(KEY), INVALID),
])
def test_refusals_say_why(store, header, reason):
    assert store.identify(header)[0] == reason


def test_a_store_with_no_keys_refuses_everything(tmp_path):
    store = ApiKeyStore.load(write_keys(tmp_path / "keys", "# nobody yet"))
    assert store.num_keys == 0
    assert store.identify(f"Bearer {KEY}")[0] == INVALID


@pytest.mark.parametrize("bad_line", [KEY, hash_key(KEY).upper(), hash_key(KEY)[:-1], hash_key(KEY) + "0",
                                      f"{hash_key(KEY)}  -", f"sha256:{hash_key(KEY)}"])
def test_a_line_that_is_not_a_digest_names_file_and_line_but_not_its_text(tmp_path, bad_line):
    path = write_keys(tmp_path / "keys", "# header", hash_key(OTHER_KEY), bad_line)
    with pytest.raises(ApiKeyFileError) as err:
        ApiKeyStore.load(path)
    message = str(err.value)
    assert str(path) in message and "line 3" in message
    assert bad_line not in message and KEY not in message and hash_key(KEY) not in message
    assert isinstance(err.value, ValueError)


def test_an_unreadable_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(ApiKeyFileError, match="missing-keys: cannot read"):
        ApiKeyStore.load(tmp_path / "missing-keys")
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ApiKeyFileError, match="binary: not UTF-8"):
        ApiKeyStore.load(tmp_path / "binary")


def test_crlf_line_endings_are_accepted(tmp_path):
    path = tmp_path / "keys"
    path.write_bytes(f"# windows\r\n{hash_key(KEY)}\r\n".encode())
    assert ApiKeyStore.load(path).identify(KEY)[0] is None


def test_reload_picks_up_added_and_removed_keys(tmp_path):
    path = write_keys(tmp_path / "keys", hash_key(KEY))
    store = ApiKeyStore.load(path)
    write_keys(path, hash_key(OTHER_KEY))
    assert store.reload() == 1
    assert store.identify(KEY)[0] == INVALID
    assert store.identify(OTHER_KEY)[0] is None


def test_a_broken_file_on_reload_keeps_the_keys_in_use(tmp_path):
    path = write_keys(tmp_path / "keys", hash_key(KEY))
    store = ApiKeyStore.load(path)
    write_keys(path, hash_key(OTHER_KEY), OTHER_KEY)  # a plaintext key pasted by mistake
    with pytest.raises(ApiKeyFileError, match="line 2"):
        store.reload()
    assert store.identify(KEY)[0] is None
    assert store.identify(OTHER_KEY)[0] == INVALID
    path.unlink()
    with pytest.raises(ApiKeyFileError, match="cannot read"):
        store.reload()
    assert store.identify(KEY)[0] is None


def test_every_digest_is_compared_whichever_matches(store, monkeypatch):
    import security.api_keys as api_keys

    calls = []
    real = api_keys.hmac.compare_digest

    def counting(a, b):
        calls.append(b)
        return real(a, b)

    monkeypatch.setattr(api_keys.hmac, "compare_digest", counting)
    for header in (KEY, OTHER_KEY, "wrong"):
        calls.clear()
        store.identify(header)[0]
        assert len(calls) == store.num_keys


def test_a_digest_may_carry_its_tenant_and_keys_naming_one_tenant_share_its_terms(tmp_path):
    third = "sk-pdserve-carol-5555"
    store = ApiKeyStore.load(write_keys(tmp_path / "keys", f"{hash_key(KEY)} name=team-a weight=3 rpm=60 tpm=1000 "
                                       "concurrency=4  # alice", f"{hash_key(OTHER_KEY)} name=team-a",
                                       hash_key(third)))
    alice, bob, carol = (store.identify(f"Bearer {k}")[1] for k in (KEY, OTHER_KEY, third))
    assert alice == bob and (alice.name, alice.weight, alice.rpm, alice.tpm, alice.concurrency) == \
        ("team-a", 3.0, 60, 1000, 4)
    assert (carol.name, carol.weight, carol.rpm) == (f"key-{hash_key(third)[:8]}", 1.0, 0)  # a bare digest: no limits
    assert store.identify("Bearer nope") == (INVALID, None)
    assert set(store.tenants()) == {"team-a", carol.name}


@pytest.mark.parametrize("tail,named", [
    ("weight=0", "weight must be a number in (0, 1000]"),
    ("weight=lots", "weight must be a number"),
    ("rpm=-1", "rpm must be a whole number in [1, 1000000000]"),
    ("tpm=1.5", "tpm must be"),
    ("concurrency=0", "concurrency must be"),
    ("name=bad!name", "name must be"),
    ("colour=red", "an unknown field"),
    ("c2stbGl2ZS1TRUNSRVQta2V5MTIz=", "an unknown field"),  # a base64 key pasted after the digest
    ("name=anonymous", "name anonymous is reserved"),
    ("rpm=5 rpm=6", "rpm is given twice"),
    ("rpm", "expected field=value"),
])
def test_a_bad_tenant_field_is_refused_naming_the_line_and_the_field_never_the_key(tmp_path, tail, named):
    path = write_keys(tmp_path / "keys", "# header", f"{hash_key(KEY)} {tail}")
    with pytest.raises(ApiKeyFileError) as refused:
        ApiKeyStore.load(path)
    assert f"line 2: {named}" in str(refused.value)
    assert hash_key(KEY) not in str(refused.value) and KEY not in str(refused.value)
    assert "c2stbGl2ZS1TRUNSRVQta2V5MTIz" not in str(refused.value)


def test_one_tenant_stated_with_two_different_terms_is_refused(tmp_path):
    path = write_keys(tmp_path / "keys", f"{hash_key(KEY)} name=a rpm=5", f"{hash_key(OTHER_KEY)} name=a rpm=6")
    with pytest.raises(ApiKeyFileError, match="line 2: tenant a has other terms on line 1"):
        ApiKeyStore.load(path)
