"""SIGHUP re-reads certificates, keys, CRLs and key files, without a restart."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

logger = logging.getLogger(__name__)


class ReloadOnSighup:
    """Named reload actions run on SIGHUP; one that fails keeps its old material and is logged."""

    def __init__(self):
        self._actions: list[tuple[str, Callable[[], None]]] = []
        self.reloads = 0

    def add(self, name: str, action: Callable[[], None]) -> None:
        self._actions.append((name, action))

    def add_all(self, parts) -> None:
        """Add each part's `reload` under its `name` (TLS links, secret files)."""
        for part in parts:
            self.add(part.name, part.reload)

    def reload(self) -> bool:
        """Run every action; True when all succeeded."""
        ok = True
        for name, action in self._actions:
            try:
                action()
            except Exception as exc:  # a bad new file must not take the process down
                ok = False
                logger.error("reload of %s failed, keeping the previous one: %s", name, exc)
        self.reloads += 1
        logger.warning("SIGHUP: reloaded %s%s", ", ".join(n for n, _ in self._actions) or "nothing",
                       "" if ok else " (with errors)")
        return ok

    def install(self) -> None:
        """Run `reload` on SIGHUP in the running event loop."""
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload)
