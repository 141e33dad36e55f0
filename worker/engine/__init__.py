"""The engine interface behind the worker's gRPC servicers, torch-free and shared by both backends: the real one
(`worker.torch_engine`, torch) and the simulated one (`worker.simulated`) serve the same life cycle over the same
block pool (`block_pool`), prefix cache and schedulers (`scheduler`).

Prefill worker, one request's life:
  0. The servicer has the backend `check_sampling` (grammar compiled, replayed tokens followed,
     logit_bias ids in the vocabulary) and `prepare_media` (each image decodes and fills its span;
     a text model takes none) on a thread, or refuses the request INVALID_ARGUMENT.
  1. `PrefillBackend.submit` waits in line until the block pool can hold the prompt, then queues it
     for the engine (a thread here, an event-loop task on the simulated backend).
  2. The engine takes the prompt's cached leading blocks from the prefix cache and prefills the rest
     in chunks, oldest prompt first, within a token and a batch-size budget per forward. During the
     last chunk's forward each layer's KV (from the first position the decode worker does not hold)
     is handed out as soon as that layer has run.
  3. The servicer opens the KV stream to the decode worker with the first layer (so neither the queue
     nor the earlier chunks count against the transfer) and streams header (`kv_layout`, first
     position), layers and trailer (first token, timing); the KV lease starts then.
  4. `PrefillBackend.release` ends the lease when the decode worker confirms receipt, when the
     lease expires, or when the request is cancelled, whichever comes first: its blocks go back to
     the pool, the full ones cached for later prompts.

Decode worker, one request's life:
  0. As for prefill: `check_sampling` (and, for a local prefill, `prepare_media`) on a thread, or
     INVALID_ARGUMENT. A sequence fed by a transfer knows its images by identity only (`media`).
  1. `DecodeBackend.register` + `admit`: the coordinator's Decode stream waits in line until the
     pool can hold the prompt and its first token (WAITING_FOR_BUDGET); one that could never fit
     (prompt + max tokens beyond the pool) is refused at once. `hold_cached_prefix` takes the
     prompt's cached leading blocks, and the request is told `accepted` with how many positions
     they hold (WAITING_FOR_KV).
  2. Either `DecodeBackend.on_kv` receives the verified cache of the remaining positions from a
     prefill worker (its transfer bounded by the time between blocks, its start only by the
     call's deadline), and the engine thread emits that worker's first token at once; or (local
     prefill) `DecodeBackend.prefill_locally` queues the prompt, whose chunks then share steps
     with decoding, and whose last chunk samples and emits the first token exactly as a prefill
     worker would (PREFILLING_LOCALLY). Either way the sequence is then queued for the batch
     (DECODING); a received cache is written into its blocks when it joins.
  3. Every step runs one packed forward: each running sequence's next token, plus at most one
     budget of prompt chunks. A sequence joins when it has blocks and a seat, takes a block when
     it fills one, and leaves at once when finished or cancelled. When the pool runs dry the
     youngest running sequence this worker can recompute is preempted: its blocks are released
     (full ones cached) and it is recomputed later and resumed. One whose images stayed with the
     prefill worker is preempted only when no other can be (a waiting sequence's blocks are taken
     first), and ends SequencePreempted, for the coordinator to continue elsewhere. A guided sequence got its grammar matcher at admission (over
     the replayed tokens and the first token); the step masks all constrained rows together
     before sampling (`grammar_masks`).
  4. `DecodeBackend.release` (end of the stream, for any reason) frees its budget and its blocks
     (full ones stay cached); the request ends FINISHED, CANCELLED or FAILED.

Nothing in this package imports torch (`tests/worker/test_engine_interface_imports.py`).
"""
