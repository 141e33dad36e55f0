"""KV events: what a worker's prefix cache holds, announced to every coordinator it serves (no torch).

Shared by both ends: the block hash and its wire form (`block_hash.py`); the batches are proto/worker.proto's
KvEventBatch. The worker's side is `worker/service/kv_event_log.py`, the coordinator's
`coordinator/workers/kv_event_watch.py` (life cycle there) and its index `coordinator/scheduling/kv_index.py`.
"""
