"""host:port and URL rules shared by the config, the management API and the gateway settings."""

from __future__ import annotations


def check_host_port(value: str) -> str:
    """`value` if it is host:port with a port in [1, 65535], else a ValueError saying so."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be host:port with a port in [1, 65535], got {value!r}")
    return value


def split_url(value: str, schemes: tuple[str, ...], form: str) -> tuple[str, str]:
    """(scheme, what follows "://") of `value` when its scheme is one of `schemes` and something follows, else a
    ValueError naming the `form` it must have."""
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in schemes or not rest:
        raise ValueError(f"must be {form}, got {value!r}")
    return scheme, rest


HTTP_URL = ("http", "https"), "http://host:port or https://host:port"
