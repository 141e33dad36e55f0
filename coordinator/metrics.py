"""Prometheus metrics of the coordinator, in one registry per app (no module globals)."""

from __future__ import annotations

import bisect
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from coordinator.requests.trace import CURRENT_REQUEST, PHASES, RequestTrace
from coordinator.http.route_table import ROUTE_TABLE, UNROUTED_LABEL
from security.api_keys import FAILURE_REASONS as AUTH_FAILURE_REASONS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Phases run from tens of microseconds (routing) to minutes (decoding a long answer).
LATENCY_BUCKETS_FINE = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, *LATENCY_BUCKETS)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

FAILURE_REASONS = {400: "bad_request", 404: "not_found", 408: "timeout", 413: "too_large", 429: "rate_limited",
                   499: "client_disconnected", 500: "internal", 503: "worker_unavailable", 504: "timeout"}


class InstanceCollector:
    """Per-instance health and outstanding work, read from the registry when scraped; with cache_affinity, the
    blocks its KV index holds of each instance and the prompt tokens routed to each, and of those the ones it
    expected the instance to hold."""

    def __init__(self, registry, index=None):
        self.instances = registry
        self.index = index
        self.routed_tokens = LoopCounter("pdserve_instance_routed_prompt_tokens",
                                         "Prompt tokens of the requests routed to the instance.", ("role", "address"))
        self.expected_cached = LoopCounter(
            "pdserve_instance_expected_cached_tokens",
            "Of the prompt tokens routed to the instance, those the KV index expected it to hold (cache_affinity): "
            "over the routed ones, the expected prefix hit rate.", ("role", "address"))

    def collect(self):
        healthy = GaugeMetricFamily("pdserve_instance_healthy", "1 if the instance is routable, else 0.",
                                    labels=["role", "address", "state"])
        requests = GaugeMetricFamily("pdserve_instance_outstanding_requests",
                                     "Requests this coordinator has on the instance.", labels=["role", "address"])
        tokens = GaugeMetricFamily("pdserve_instance_outstanding_prompt_tokens",
                                   "Prompt tokens sent to the prefill instance and not yet prefilled.",
                                   labels=["role", "address"])
        for role in ("prefill", "decode", "encode"):
            for i in self.instances.instances(role):
                healthy.add_metric([role, i.address, i.state.value], 1.0 if i.available else 0.0)
                requests.add_metric([role, i.address], i.outstanding_requests)
                tokens.add_metric([role, i.address], i.outstanding_prompt_tokens)
        families = [healthy, requests, tokens]
        if self.index is not None:
            blocks = GaugeMetricFamily("pdserve_instance_kv_index_blocks",
                                       "KV blocks the instance holds in its prefix cache, as its KV events told "
                                       "this coordinator, by medium: pool (its block pool) or tier (its KV tier).",
                                       labels=["role", "address", "medium"])
            for role in ("prefill", "decode"):
                for i in self.instances.instances(role):
                    for medium in ("pool", "tier"):
                        blocks.add_metric([role, i.address, medium], self.index.blocks_of(i.address, medium))
            families += [blocks, self.routed_tokens.family(), self.expected_cached.family()]
        return families


class LoopHistogram:
    """A histogram observed only from the event loop: a bisect and two additions per value, no lock (a
    prometheus_client Histogram takes a lock per observation, once per streamed token here). With `labelnames`,
    a family: `child(labels)` is the histogram of one label set."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], labelnames: tuple[str, ...] = ()):
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.total = 0.0
        self.children: dict[tuple[str, ...], LoopHistogram] = {}

    def child(self, labels: tuple[str, ...]) -> LoopHistogram:
        child = self.children.get(labels)
        if child is None:
            child = self.children[labels] = LoopHistogram(self.name, self.documentation, tuple(self.bounds))
        return child

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        cumulative, running = [], 0
        # As prometheus_client labels its own buckets (le="1.0"), so series keep their names across versions.
        for bound, count in zip([*map(floatToGoString, self.bounds), "+Inf"], self.counts):
            running += count
            cumulative.append((bound, running))
        return cumulative

    def family(self) -> HistogramMetricFamily:
        if not self.labelnames:
            return HistogramMetricFamily(self.name, self.documentation, buckets=self.cumulative(),
                                         sum_value=self.total)
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, child in self.children.items():
            family.add_metric(list(labels), child.cumulative(), child.total)
        return family


class LoopCounter:
    """A counter family bumped only from the event loop: one dict update per increment, no lock."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...] = ()):
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, labels: tuple[str, ...] = (), amount: float = 1.0) -> None:
        values = self.values
        values[labels] = values.get(labels, 0.0) + amount

    def family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in self.values.items():
            family.add_metric(list(labels), value)
        return family


class RequestCollector:
    """The figures every generation request moves (counts, latencies, phases), kept on the event loop and read
    at scrape time: about a dozen locked prometheus_client updates per request otherwise."""

    def __init__(self):
        self.received = LoopCounter("pdserve_requests_received", "Generation requests received.", ("api",))
        self.finished = LoopCounter("pdserve_requests_finished",
                                    "Generation requests finished, by HTTP status ('200' = success).",
                                    ("api", "status"))
        self.running = 0
        self.e2e = LoopHistogram("pdserve_e2e_request_latency_seconds", "Request latency, arrival to last byte.",
                                 LATENCY_BUCKETS, ("api",))
        self.prompt_tokens = LoopCounter("pdserve_prompt_tokens", "Prompt tokens of finished requests.")
        self.prompt_tokens.inc(amount=0.0)  # exported at zero from the start, as prometheus_client does
        self.queue_time = LoopHistogram("pdserve_request_queue_time_seconds",
                                        "Time from arrival to leaving the coordinator's queue.", LATENCY_BUCKETS)
        self.phase_seconds = LoopHistogram(
            "pdserve_request_phase_seconds", "Time a generation spent in each phase (coordinator/requests/trace.py): "
            "queue, route, decode_admission, prefill (of it, as the prefill worker timed them: prefill_queue, "
            "prefill_forward, kv_transfer), first_token, decode, summed over its attempts; tokenize once per "
            "client request (all its prompts).", LATENCY_BUCKETS_FINE, ("phase",))

    def collect(self):
        running = GaugeMetricFamily("pdserve_requests_running", "Generation requests in flight.", value=self.running)
        return [self.received.family(), self.finished.family(), running, self.e2e.family(),
                self.prompt_tokens.family(), self.queue_time.family(), self.phase_seconds.family()]


class TokenCollector:
    """Per-token figures (TTFT, gaps between tokens, tokens generated), kept on the event loop and read at
    scrape time."""

    def __init__(self):
        self.ttft = LoopHistogram("pdserve_time_to_first_token_seconds", "Arrival to first generated token.",
                                  LATENCY_BUCKETS)
        self.tpot = LoopHistogram("pdserve_time_per_output_token_seconds", "Gap between generated tokens.",
                                  TOKEN_BUCKETS)
        self.generated = 0

    def collect(self):
        tokens = CounterMetricFamily("pdserve_generation_tokens", "Tokens generated.")
        tokens.add_metric([], self.generated)
        return [self.ttft.family(), self.tpot.family(), tokens]


class PlannerCollector:
    """The online planner's desired counts (what a Kubernetes HPA scales each role's workers on), its decisions
    by reason, and the SLO attainment it last saw."""

    def __init__(self, planner):
        self.planner = planner

    def collect(self):
        planner = self.planner
        desired = GaugeMetricFamily("pdserve_planner_desired_instances", "Instances of the role the online planner "
                                    "wants (damped); absent until its first decision and on a standby.",
                                    labels=["role"])
        current = GaugeMetricFamily("pdserve_planner_current_instances", "Routable instances of the role, as the "
                                    "planner counts them.", labels=["role"])
        for role, count in planner.describe_counts("current").items():
            current.add_metric([role], count)
        if planner.deciding and planner.damper.desired is not None:
            for role, count in planner.describe_counts("desired").items():
                desired.add_metric([role], count)
        decisions = CounterMetricFamily("pdserve_planner_decisions", "Planner decisions by reason: meets_slo, "
                                        "best_effort, warming_up, cannot_simulate, or held (new counts waiting on the "
                                        "damping).", labels=["reason"])
        for reason, count in planner.decisions.items():
            decisions.add_metric([reason], count)
        attainment = GaugeMetricFamily("pdserve_planner_slo_attainment", "Share of the window's requests within "
                                       "the target: ttft, tpot, or both.", labels=["target"])
        last = planner.last
        if last is not None and last.attainment is not None:
            for target in ("ttft", "tpot", "both"):
                attainment.add_metric([target], getattr(last.attainment, target))
        return [desired, current, decisions, attainment]


class TenantCollector:
    """Per tenant: client requests admitted and refused (by reason), tokens charged, time waited in the line."""

    def __init__(self, book):
        self.book = book

    def collect(self):
        admitted = CounterMetricFamily("pdserve_tenant_requests_admitted", "Client requests admitted, by tenant.",
                                       labels=["tenant"])
        refused = CounterMetricFamily("pdserve_tenant_requests_refused", "Client requests refused, by tenant and "
                                      "reason: concurrency, rpm, tpm (429), deadline (could not start in time).",
                                      labels=["tenant", "reason"])
        tokens = CounterMetricFamily("pdserve_tenant_tokens", "Tokens charged to the tenant: prompt, output.",
                                     labels=["tenant", "kind"])
        queued = CounterMetricFamily("pdserve_tenant_queue_seconds", "Seconds the tenant's generations waited in "
                                     "the coordinator's line, summed.", labels=["tenant"])
        queued_count = CounterMetricFamily("pdserve_tenant_queued", "Generations of the tenant that left the line.",
                                           labels=["tenant"])
        in_flight = GaugeMetricFamily("pdserve_tenant_requests_in_flight", "Client requests of the tenant in "
                                      "flight on this coordinator.", labels=["tenant"])
        for name, tenant in list(self.book.tenants.items()):
            tenant.settle()
            admitted.add_metric([name], tenant.admitted)
            for reason, count in tenant.refused.items():
                refused.add_metric([name, reason], count)
            tokens.add_metric([name, "prompt"], tenant.prompt_tokens)
            tokens.add_metric([name, "output"], tenant.output_tokens)
            queued.add_metric([name], tenant.queue_seconds)
            queued_count.add_metric([name], tenant.queued)
            in_flight.add_metric([name], tenant.in_flight)
        return [admitted, refused, tokens, queued, queued_count, in_flight]


class DraftCollector:
    """Speculative decoding as the coordinator sees it: draft hints sent, generations with drafting off and, with
    speculative_config.enabled, what the draft corpus keeps (all tenants together: no tenant label)."""

    def __init__(self):
        self.hints_sent = 0
        self.drafting_off = 0
        self.corpus = None  # a DraftCorpus, read when scraped

    def collect(self):
        families = [
            CounterMetricFamily("pdserve_draft_hints_sent", "Draft hints sent with decode requests, from the "
                                "coordinator's corpus (speculative_config).", value=self.hints_sent),
            CounterMetricFamily("pdserve_requests_drafting_off", "Generations sent with speculative drafting turned "
                                "off by their client (x-pdserve-speculative: off).", value=self.drafting_off)]
        corpus = self.corpus
        if corpus is not None:
            families += [
                GaugeMetricFamily("pdserve_draft_corpus_entries", "Outputs the draft corpus keeps.",
                                  value=corpus.num_entries),
                GaugeMetricFamily("pdserve_draft_corpus_tokens", "Tokens the draft corpus keeps, as "
                                  "speculative_config.max_total_tokens counts them.", value=corpus.num_tokens)]
        return families


def api_label(request: web.Request) -> str:
    """The `api` label of a request: its route's metrics label in the app's route table."""
    return request.app[ROUTE_TABLE].metrics_label(request.method, request.path) or UNROUTED_LABEL


class CoordinatorMetrics:
    """Request counts and latencies, by client API and outcome."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = RequestCollector()
        r.register(self.requests)
        self.tokens = TokenCollector()
        r.register(self.tokens)
        self.drafts = DraftCollector()
        r.register(self.drafts)
        self.retries = Counter("pdserve_prefill_retries_total",
                               "Requests restarted on other instances before their first token.", registry=r)
        self.migrations = Counter("pdserve_request_migrations_total",
                                  "Streams moved to another decode instance after theirs was lost.", registry=r)
        self.rebalances = Counter("pdserve_request_rebalances_total", "Running streams moved off a crowded decode "
                                  "instance to even out the decode load (rebalance_config).", registry=r)
        self.wire_formats = Counter("pdserve_wire_format_requests_total", "Requests by the version of each wire "
                                    "format they used (kv_layout: prefill to decode; decode_request: to the decode "
                                    "worker), for watching a rolling upgrade.", ["format", "version"], registry=r)
        self._wire_formats: dict[tuple[str, int], object] = {}
        self.failed = Counter("pdserve_requests_failed_total", "Generation requests that failed, by reason.",
                              ["api", "reason"], registry=r)
        self.waiting = Gauge("pdserve_requests_waiting", "Generation requests waiting in the coordinator's queue.",
                             registry=r)
        # Every phase exported from the start, at zero; the children kept, so a phase costs one dict lookup.
        self._phases = {phase: self.requests.phase_seconds.child((phase,)) for phase in PHASES}
        self.auth_failures = Counter("pdserve_auth_failures_total",
                                     "Requests refused for their API key, by reason (missing, malformed, invalid).",
                                     ["reason"], registry=r)
        for reason in AUTH_FAILURE_REASONS:
            self.auth_failures.labels(reason)  # every reason reads 0 from the start, for alerts on its rate

    def watch(self, queue, registry, index=None) -> None:
        """Read the queue length and every instance's health and load (and, given a KvIndex, what it holds of
        each) at scrape time."""
        self.waiting.set_function(lambda: queue.num_waiting)
        self.instances = InstanceCollector(registry, index)
        self.registry.register(self.instances)

    def watch_tenants(self, book) -> None:
        """Export each tenant's figures (tenancy/admission.py's TenantBook)."""
        self.registry.register(TenantCollector(book))

    def watch_planner(self, planner) -> None:
        """Export the online planner's decisions (a PlannerLoop), read when scraped."""
        self.registry.register(PlannerCollector(planner))

    def watch_drafts(self, corpus) -> None:
        """Export what the draft corpus (requests/draft_corpus.py) keeps, read when scraped."""
        self.drafts.corpus = corpus

    def hints_sent(self, count: int) -> None:
        self.drafts.hints_sent += count

    def drafting_off(self) -> None:
        self.drafts.drafting_off += 1

    def routed(self, role: str, address: str, prompt_tokens: int, expected_cached: int) -> None:
        """A request routed to an instance the KV index priced (cache_affinity)."""
        labels = (role, address)
        self.instances.routed_tokens.inc(labels, prompt_tokens)
        self.instances.expected_cached.inc(labels, expected_cached)

    def fail(self, api: str, status: int) -> None:
        self.failed.labels(api, FAILURE_REASONS.get(status, "client_error" if status < 500 else "server_error")).inc()

    def queued(self, seconds: float) -> None:
        self.requests.queue_time.observe(seconds)

    def token(self, index: int, since_start_s: float, since_last_s: float) -> None:
        tokens = self.tokens
        if index == 0:
            tokens.ttft.observe(since_start_s)
        else:
            tokens.tpot.observe(since_last_s)
        tokens.generated += 1

    def generation_done(self, prompt_tokens: int) -> None:
        self.requests.prompt_tokens.inc(amount=prompt_tokens)

    def phase(self, name: str, seconds: float) -> None:
        self._phases[name].observe(seconds)

    def phases(self, durations: dict[str, float]) -> None:
        for name, seconds in durations.items():
            self._phases[name].observe(seconds)

    def retried(self) -> None:
        self.retries.inc()

    def migrated(self) -> None:
        self.migrations.inc()

    def rebalanced(self) -> None:
        self.rebalances.inc()

    def wire_format(self, name: str, version: int) -> None:
        child = self._wire_formats.get((name, version))
        if child is None:
            child = self._wire_formats[(name, version)] = self.wire_formats.labels(name, str(version))
        child.inc()

    def auth_failed(self, reason: str) -> None:
        self.auth_failures.labels(reason).inc()

    def request_opened(self, api: str, request: web.Request) -> tuple[RequestTrace, object, float]:
        """A client API call begins (RequestGate): counted as running, its root span opened and made current."""
        requests = self.requests
        requests.received.inc((api,))
        requests.running += 1
        # The route's template (`/v2/models/{model}/generate`), not the path, as OpenTelemetry's HTTP
        # conventions name a server span: span names stay few; an unrouted request is its method alone.
        resource = request.match_info.route.resource
        trace = RequestTrace(request.method, resource.canonical if resource is not None else "", request.headers)
        return trace, CURRENT_REQUEST.set(trace), time.perf_counter()

    def request_closed(self, api: str, opened: tuple[RequestTrace, object, float], status: int) -> None:
        """It ended with `status` (499: the client went away)."""
        trace, current, started = opened
        CURRENT_REQUEST.reset(current)
        trace.end(status)
        if trace.tokenize_s:
            self.phase("tokenize", trace.tokenize_s)
        if status != 200:
            self.fail(api, status)
        requests = self.requests
        requests.running -= 1
        requests.finished.inc((api, str(status)))
        requests.e2e.child((api,)).observe(time.perf_counter() - started)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


class NullMetrics:
    """CoordinatorMetrics' request-pipeline methods, recording nothing: for a pipeline built outside an app."""

    def queued(self, seconds: float) -> None:
        pass

    def token(self, index: int, since_start_s: float, since_last_s: float) -> None:
        pass

    def generation_done(self, prompt_tokens: int) -> None:
        pass

    def phases(self, durations: dict[str, float]) -> None:
        pass

    def retried(self) -> None:
        pass

    def migrated(self) -> None:
        pass

    def rebalanced(self) -> None:
        pass

    def wire_format(self, name: str, version: int) -> None:
        pass

    def auth_failed(self, reason: str) -> None:
        pass

    def routed(self, role: str, address: str, prompt_tokens: int, expected_cached: int) -> None:
        pass

    def hints_sent(self, count: int) -> None:
        pass

    def drafting_off(self) -> None:
        pass


METRICS = web.AppKey("metrics", CoordinatorMetrics)
