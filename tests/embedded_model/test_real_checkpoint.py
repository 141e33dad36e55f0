"""The real checkpoint's build: processes asking at once build it once (pytest-xdist workers did race)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from embedded_model import real_checkpoint


def test_callers_asking_at_once_build_the_checkpoint_once_and_all_get_the_folder(tmp_path, monkeypatch):
    builds = []

    def slow_build(out: Path) -> None:
        builds.append(out)
        time.sleep(0.2)  # long enough that the other callers arrive while it builds
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(real_checkpoint, "_build", slow_build)
    out = tmp_path / "models" / real_checkpoint.NAME
    results = []
    threads = [threading.Thread(target=lambda: results.append(real_checkpoint.ensure_real_checkpoint(out)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [out] * 4
    assert builds == [out]
