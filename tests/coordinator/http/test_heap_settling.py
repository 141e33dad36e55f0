"""settle_heap: once start-up is done, its heap is frozen out of the collector's reach and young collections wait
for YOUNG_COLLECTION_AFTER objects."""

from __future__ import annotations

import gc

from coordinator.http.server import YOUNG_COLLECTION_AFTER, settle_heap


def test_settling_freezes_what_start_up_built_and_spaces_young_collections():
    before = gc.get_threshold()
    kept = [[] for _ in range(1000)]  # containers: what the collector tracks
    try:
        settle_heap()
        assert gc.get_freeze_count() >= len(kept)
        assert gc.get_threshold() == (YOUNG_COLLECTION_AFTER, *before[1:])
    finally:  # this test process keeps collecting as before
        gc.unfreeze()
        gc.set_threshold(*before)
