"""Waits on what a coordinator's management port lists (with the registration token): `pdserve up` starting."""

from __future__ import annotations

import json
import ssl
import time
import urllib.request
from collections.abc import Callable

from launcher.supervisor import Supervisor


def wait_listed(supervisor: Supervisor, management_url: str, path: str, token: str, count: int,
                counted: Callable[[dict], int], timeout_s: float, what: str,
                context: ssl.SSLContext | None = None) -> None:
    """Until `counted` of GET `path`'s answer reaches `count`; RuntimeError saying `what` was awaited after
    `timeout_s` (the supervisor runs meanwhile: a signal or a child's exit ends the wait)."""
    request = urllib.request.Request(f"{management_url}{path}", headers={"Authorization": f"Bearer {token}"})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(request, timeout=2, context=context) as resp:
                if counted(json.loads(resp.read())) >= count:
                    return
        except OSError:
            pass
        supervisor.run_for(0.2)
    raise RuntimeError(f"{what} within {timeout_s:g}s")
