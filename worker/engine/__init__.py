"""The engines behind the worker's gRPC servicers: the real ones here (torch), the simulated ones in
`worker.simulated`; both are backends of `PrefillBackend` / `DecodeBackend` and serve the same life cycle.

Prefill worker, one request's life:
  0. The servicer has the backend `check_sampling` (grammar compiled, replayed tokens followed,
     logit_bias ids in the vocabulary) on a thread, or refuses the request INVALID_ARGUMENT.
  1. `PrefillBackend.submit` waits in line until the KV budget can hold the prompt (the lease
     starts here), then queues the prompt for the engine (a thread here, an
     event-loop task on the simulated backend).
  2. The engine prefills queued prompts together, right-padded, within the token and
     batch-size budgets; each layer's KV is handed out as soon as that layer has run.
  3. The servicer streams header (`kv_layout`), layers and trailer (first token, timing) to the decode worker.
  4. `PrefillBackend.release` ends the lease when the decode worker confirms receipt, when the
     lease expires, or when the request is cancelled, whichever comes first.

Decode worker, one request's life:
  0. As for prefill: `check_sampling` on a thread, or INVALID_ARGUMENT.
  1. `DecodeBackend.register` + `admit`: the coordinator's Decode stream waits in line until the
     KV budget can hold prompt + max tokens (WAITING_FOR_BUDGET), then is told `accepted`
     (WAITING_FOR_KV).
  2. Either `DecodeBackend.on_kv` receives the verified cache from a prefill worker, and the
     engine thread emits that worker's first token at once; or (local prefill, no prefill worker)
     `DecodeBackend.prefill_locally` queues the prompt, and the engine thread prefills queued
     prompts together between decode steps and samples and emits the first token itself, exactly
     as a prefill worker would (PREFILLING_LOCALLY). Either way the sequence is then queued for the
     batch (DECODING).
  3. Every step runs one batched forward over all running sequences; a sequence joins at the
     next step and a finished or cancelled one leaves at once, freeing its rows. A guided
     sequence got its grammar matcher at admission (over the replayed tokens and the first token);
     the step masks all constrained rows together before sampling (`grammar_masks`).
  4. `DecodeBackend.release` (end of the stream, for any reason) frees the budget; the request ends
     FINISHED, CANCELLED or FAILED.

Only `model_runner`, `batch_cache`, `sampling`, the two engines and `build` import torch; the
rest of this package is shared with the simulated backend and must stay torch-free.
"""

