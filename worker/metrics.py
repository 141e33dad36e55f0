"""Prometheus metrics of one worker, served on its own port (`--metrics-port`), and their no-op stand-in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from worker.engine.speculative.counts import SKIP_REASONS, DraftCounts

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class WorkerMetrics:
    """Queue, KV budget, transfer and step metrics; gauges read the engine when scraped."""

    def __init__(self, role: str, engine):
        self.registry = r = CollectorRegistry()
        if role == "encode":
            self._encoder_gauges(engine)
        else:
            self._pool_gauges(role, engine)
        vision = getattr(engine, "vision", None) or getattr(getattr(engine, "runner", None), "vision", None)
        if vision is not None:
            r.register(EncoderCacheCounters(vision.cache))
        self.encoded_images = Counter("pdserve_worker_encoded_images_total", "Encode worker: images of Encode calls, "
                                      "by outcome: encoded (by its vision tower) or cached (its output was held).",
                                      ["outcome"], registry=r)
        self.embedding_pulls = Counter("pdserve_worker_embedding_pulls_total", "Images' encoder outputs moved between "
                                       "workers, by outcome: pulled (a prefill worker took them from an encode "
                                       "worker), failed (the pull failed: the coordinator sent the file instead) or "
                                       "served (an encode worker sent them).", ["outcome"], registry=r)
        self.embedding_bytes = Counter("pdserve_worker_embedding_bytes_total", "Bytes of images' encoder outputs: "
                                       "sent (encode worker) or received and verified (prefill worker).", ["side"],
                                       registry=r)
        for outcome in ("encoded", "cached"):
            self.encoded_images.labels(outcome)
        for outcome in ("pulled", "failed", "served"):
            self.embedding_pulls.labels(outcome)
        for side in ("sent", "received"):
            self.embedding_bytes.labels(side)
        self._transfer_counters()

    def _encoder_gauges(self, engine) -> None:
        r = self.registry
        Gauge("pdserve_worker_encoder_queue_images", "Encode worker: images waiting for a vision forward.",
              registry=r).set_function(lambda: engine.num_waiting)
        Gauge("pdserve_worker_encoder_running_images", "Encode worker: images in the vision forward now.",
              registry=r).set_function(lambda: engine.num_running)
        Gauge("pdserve_worker_encoder_cached_images", "Encode worker: images whose encoder output it holds.",
              registry=r).set_function(lambda: len(engine.vision.cache))

    def _pool_gauges(self, role: str, engine) -> None:
        r = self.registry
        budget = engine.admission.budget
        Gauge("pdserve_worker_kv_budget_used_tokens", "KV budget held now, in token positions.",
              registry=r).set_function(lambda: budget.used)
        Gauge("pdserve_worker_kv_budget_capacity_tokens", "KV budget of this worker, in token positions.",
              registry=r).set_function(lambda: budget.capacity)
        Gauge("pdserve_worker_waiting_requests", "Requests waiting for KV budget.",
              registry=r).set_function(lambda: engine.admission.num_waiting)
        if role == "decode":
            Gauge("pdserve_worker_running_sequences", "Sequences in the decode batch.",
                  registry=r).set_function(lambda: engine.scheduler.num_running)
        else:
            Gauge("pdserve_worker_kv_leases", "KV caches held until the decode worker confirms.",
                  registry=r).set_function(lambda: len(engine.leases))
            Gauge("pdserve_worker_queued_prompt_tokens", "Prompt tokens waiting to be prefilled.",
                  registry=r).set_function(lambda: engine.num_queued_tokens)
        pool = engine.pool
        blocks = Gauge("pdserve_worker_kv_pool_blocks", "KV blocks in the pool, by state: used (held by live "
                       "requests), cached (unreferenced, kept for the prefix cache, evictable) or free.", ["state"],
                       registry=r)
        blocks.labels("used").set_function(lambda: pool.stats().used_blocks)
        blocks.labels("cached").set_function(lambda: pool.stats().cached_blocks)
        blocks.labels("free").set_function(lambda: pool.stats().free_blocks - pool.stats().cached_blocks)
        r.register(PrefixCacheCounters(pool))
        if getattr(engine, "loras", None) is not None:
            r.register(LoraInfo(engine.loras))
        if role == "decode":
            r.register(SpeculativeCounters(engine))

    def _transfer_counters(self) -> None:
        r = self.registry
        # side: send (prefill: first byte to the decode worker's ack) or receive (decode: header to last block,
        # verified); transport: tcp (the raw-TCP data port) or grpc (the KvReceiver stream).
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes_total", "KV cache bytes sent (prefill) or received "
                                "and verified (decode).", ["side", "transport"], registry=r)
        self.kv_duration = Histogram("pdserve_kv_transfer_duration_seconds", "KV transfer time as each end measures "
                                     "it: send (prefill, until the decode worker's ack) or receive (decode, header "
                                     "to last block).", ["side", "transport"], buckets=TRANSFER_BUCKETS, registry=r)
        self.kv_pulls = Counter("pdserve_worker_kv_pulls_total", "Peer pulls of a prompt's leading KV blocks, by "
                                "outcome: pulled (this worker fetched them from a peer), failed (it computed them "
                                "instead) or served (a peer fetched them from this worker).", ["outcome"], registry=r)
        self.kv_pull_bytes = Counter("pdserve_worker_kv_pull_bytes_total", "KV bytes moved by peer pulls: pulled "
                                     "(received and verified here) or served (sent to a peer).", ["outcome"],
                                     registry=r)
        for outcome in ("pulled", "failed", "served"):  # every series from the start, at 0
            self.kv_pulls.labels(outcome)
            if outcome != "failed":
                self.kv_pull_bytes.labels(outcome)
        self.kv_failures = Counter("pdserve_kv_transfer_failures_total", "KV transfers that failed.", registry=r)
        self.kv_refused = Counter("pdserve_worker_kv_streams_refused_total", "Decode worker: KV streams refused "
                                  "for a missing, wrong or spent transfer token.", registry=r)
        self.kv_receive_fallbacks = Counter(
            "pdserve_worker_kv_receive_fallbacks_total", "Decode worker: KV streams received into a receive buffer and "
            "copied into their blocks when the sequence joins, instead of straight into the block pool, by reason: "
            "no_room (the pool could not spare the blocks when the header came), device (the pool is not on the CPU), "
            "engine_busy (the engine thread did not answer in time).", ["reason"], registry=r)
        self.requests = Counter("pdserve_worker_requests_total", "Requests this worker admitted (gave KV budget to).",
                                registry=r)
        self.step = Histogram("pdserve_worker_step_duration_seconds", "One engine forward (prefill or decode).",
                              ["kind"], buckets=STEP_BUCKETS, registry=r)
        self.batch = Histogram("pdserve_worker_batch_size", "Sequences per engine forward.", ["kind"],
                               buckets=BATCH_BUCKETS, registry=r)

    def observe_step(self, kind: str, seconds: float, batch_size: int) -> None:
        self.step.labels(kind).observe(seconds)
        self.batch.labels(kind).observe(batch_size)



class ProcessMetrics:
    """A worker process's /metrics: the serving round's WorkerMetrics (a role switch starts another round, whose
    counters start again from 0), and what outlives switches."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.registry.register(_CurrentRound(self))
        self.current: WorkerMetrics | None = None
        self.role_switches = Counter("pdserve_worker_role_switches_total", "Role switches in place, by the role "
                                     "switched to.", ["role"], registry=self.registry)
        self.model_loads = Counter("pdserve_worker_model_loads_total", "Checkpoints loaded by this process: 1 for a "
                                   "real worker however often it switches roles, 0 for a simulated one.",
                                   registry=self.registry)
        for role in ("prefill", "decode"):  # an encode worker does not switch
            self.role_switches.labels(role)

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP server; return the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port


class _CurrentRound:
    def __init__(self, process: ProcessMetrics):
        self.process = process

    def collect(self):
        current = self.process.current
        return current.registry.collect() if current is not None else []


class PrefixCacheCounters:
    """The pool's prefix cache lookups as counters, read when scraped: the hit rate is hits / queried."""

    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        stats = self.pool.stats()
        yield CounterMetricFamily("pdserve_worker_prefix_cache_hit_tokens", "Prompt positions found in the prefix "
                                  "cache (not computed again).", value=stats.hit_tokens)
        yield CounterMetricFamily("pdserve_worker_prefix_cache_queried_tokens", "Prompt positions looked up in the "
                                  "prefix cache.", value=stats.queried_tokens)
        # Present without a tier too (zeros), so dashboards and alerts need not know which workers have one.
        yield CounterMetricFamily("pdserve_worker_kv_tier_hit_tokens", "Prompt positions loaded from the KV tier "
                                  "(part of the prefix cache's hits).", value=stats.tier_hit_tokens)
        tier = self.pool.tier
        t = tier.stats() if tier is not None else None
        yield GaugeMetricFamily("pdserve_worker_kv_tier_blocks", "KV blocks the tier holds.",
                                value=t.blocks if t else 0)
        yield GaugeMetricFamily("pdserve_worker_kv_tier_capacity_blocks", "KV blocks the tier can hold (0: no tier, "
                                "or a disk error turned it off).", value=t.capacity_blocks if t and t.enabled else 0)
        yield CounterMetricFamily("pdserve_worker_kv_tier_written_blocks", "KV blocks written to the tier.",
                                  value=t.written_blocks if t else 0)
        yield CounterMetricFamily("pdserve_worker_kv_tier_dropped_blocks", "Tier blocks found damaged or missing "
                                  "when read (recomputed).", value=t.dropped_blocks if t else 0)


class LoraInfo:
    """The adapters in use, as vLLM's `vllm:lora_requests_info` reports them (what the Gateway API Inference
    Extension routes on): a gauge of 1 whose labels name the running and waiting adapters, read when scraped."""

    def __init__(self, loras):
        self.loras = loras

    def collect(self):
        loras = self.loras
        family = GaugeMetricFamily("pdserve_worker_lora_requests_info", "LoRA adapters pinned by requests "
                                   "(running_lora_adapters) and waited for (waiting_lora_adapters), comma-separated; "
                                   "max_lora: adapters held at once.",
                                   labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        # Snapshots (tuple() of a dict is one step under the GIL): the event loop changes them meanwhile.
        family.add_metric([",".join(loras.running), ",".join(tuple(loras.waiting)), str(loras.max_loras)], 1)
        yield family
        yield GaugeMetricFamily("pdserve_worker_lora_resident_adapters", "LoRA adapters loaded on this worker now.",
                                value=len(loras.resident))


class EncoderCacheCounters:
    """A vision-language model's encoder cache lookups (images by content hash), read when scraped."""

    def __init__(self, cache):
        self.cache = cache

    def collect(self):
        yield CounterMetricFamily("pdserve_worker_encoder_cache_hits", "Vision-language models: images whose "
                                  "encoder output was found cached (not encoded again).", value=self.cache.hits)
        yield CounterMetricFamily("pdserve_worker_encoder_cache_misses", "Vision-language models: images encoded "
                                  "(not found cached).", value=self.cache.misses)


class SpeculativeCounters:
    """A drafting decode worker's acceptance, named after vLLM's `spec_decode_*` metrics; mean acceptance length is
    1 + accepted / drafts. Present at 0 on a decode worker that does not draft, so dashboards need not know which do."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        drafter = getattr(self.engine, "drafter", None)
        counts = drafter.counts if drafter is not None else DraftCounts()
        yield CounterMetricFamily("pdserve_worker_spec_decode_num_drafts", "Decode rows verified with a draft "
                                  "(one per row and step).", value=counts.drafts)
        yield CounterMetricFamily("pdserve_worker_spec_decode_num_draft_tokens", "Draft tokens verified.",
                                  value=counts.draft_tokens)
        yield CounterMetricFamily("pdserve_worker_spec_decode_num_accepted_tokens", "Draft tokens accepted (each "
                                  "saves a decode step).", value=counts.accepted)
        per_position = CounterMetricFamily("pdserve_worker_spec_decode_num_accepted_tokens_per_pos", "Draft tokens "
                                           "accepted at each position of a draft (0: the first).", labels=["position"])
        for position, accepted in enumerate(counts.accepted_per_position):
            per_position.add_metric([str(position)], accepted)
        yield per_position
        skipped = CounterMetricFamily("pdserve_worker_spec_decode_skipped_rows", "Decode rows that did not draft in "
                                      "a step, by reason: batch_size (the step had more rows than "
                                      "--speculative-disable-batch-size), request_off (the client turned it off), "
                                      "guided (a grammar), cooldown (its last drafts were all rejected), no_match "
                                      "(nothing to draft from), length (at its last token), no_blocks (no KV "
                                      "blocks for the draft).", labels=["reason"])
        for reason in SKIP_REASONS:
            skipped.add_metric([reason], counts.skipped[reason])
        yield skipped


class _NoOp:
    def labels(self, *values: str) -> _NoOp:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass


class NullMetrics:
    """WorkerMetrics' methods doing nothing: what an engine records into before (or without) a metrics server."""

    kv_bytes = kv_duration = kv_failures = kv_refused = kv_receive_fallbacks = requests = _NoOp()

    def observe_step(self, kind: str, seconds: float, batch_size: int) -> None:
        pass


NULL_METRICS = NullMetrics()
