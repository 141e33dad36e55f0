"""KvEventWatch: the coordinator follows every routable worker's KV events into its KvIndex.

Life of one instance's watch:
  1. The instance becomes routable (configured, registered, healthy again): the watch subscribes, on the
     worker's token channel when one is open (and streams KV events), else with a KvEvents.Watch call.
  2. The first batch is a snapshot (`reset`): the index forgets what it held of the instance and takes it.
  3. Every later batch is applied in order. A gap in the numbering drops the instance's entries and asks for
     a new snapshot (on the channel, ignoring what comes before it) or subscribes again (a call).
  4. A token channel that opens while a call is followed takes over: the call ends, and the channel's own
     snapshot replaces the entries.
  5. The stream or channel breaking drops the instance's entries; the watch subscribes again after RETRY_S
     (doubling up to MAX_RETRY_S), so a restarted worker's snapshot replaces them within a heartbeat.
  6. The instance stops being routable (it left, was declared lost, turned unhealthy or drains): the watch
     ends and its entries go (batches still in flight for it are left alone). A worker that serves no KvEvents
     (UNIMPLEMENTED) is asked again every UNIMPLEMENTED_RETRY_S: meanwhile routing sees no cache on it.
On etcd replicas every coordinator's registry holds every worker, so each follows them all and their indexes
agree without sharing anything through etcd.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from coordinator.workers.instances import KV_ROLES, Instance, InstanceRegistry
from coordinator.scheduling.kv_index import KvIndex
from coordinator.workers.token_channels import TokenChannel
from coordinator.workers.client import WorkerClient
from proto import worker_pb2 as pb

logger = logging.getLogger(__name__)

RETRY_S = 0.25
MAX_RETRY_S = 1.0
UNIMPLEMENTED_RETRY_S = 60.0


class EventsLost(Exception):
    """A batch's numbering showed that events were missed: the subscription starts over."""


class InstanceFollowers:
    """One task per routable instance that `_follows` says to follow, started as the pools admit the instance and
    cancelled as they evict it (its entries in `index` dropped); a subclass says how to follow one (`_follow`)."""

    def __init__(self, index: KvIndex, roles: tuple[str, ...] = KV_ROLES):
        self.index = index
        self.roles = roles  # whose instances it follows: KV caches, or encode workers' images
        self._tasks: dict[str, asyncio.Task] = {}

    def start(self, registry: InstanceRegistry) -> None:
        """Follow every routable instance of its roles from now on (the pools admit and evict them as they
        change)."""
        for role in self.roles:
            registry.pool(role).watch(self)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _follows(self, instance: Instance) -> bool:
        return True

    async def _follow(self, instance: Instance) -> None:
        raise NotImplementedError

    def _current(self, address: str, task: asyncio.Task | None) -> bool:
        """Whether `task` still follows `address` (an evicted instance's late batches must not bring it back)."""
        return self._tasks.get(address) is task

    # the pools' side (PoolWatcher) ---------------------------------------------------------------------
    def admit(self, instance: Instance) -> None:
        if instance.address not in self._tasks and self._follows(instance):
            self._tasks[instance.address] = asyncio.get_running_loop().create_task(self._follow(instance))

    def evict(self, instance: Instance) -> None:
        task = self._tasks.pop(instance.address, None)
        if task is not None:
            task.cancel()
        self.index.drop(instance.address)

    def update(self, instance: Instance) -> None:
        pass  # load changes say nothing about the cache


class KvEventWatch(InstanceFollowers):
    """One subscription per routable worker, fed into `index` (life cycle above)."""

    def __init__(self, index: KvIndex, client: WorkerClient, retry_s: float = RETRY_S,
                 max_retry_s: float = MAX_RETRY_S, roles: tuple[str, ...] = KV_ROLES):
        super().__init__(index, roles)
        self.client = client
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self._channel_opened: dict[str, asyncio.Event] = {}

    def start(self, registry: InstanceRegistry) -> None:
        self.client.token_channels.on_open.append(self._opened)
        super().start(registry)

    def evict(self, instance: Instance) -> None:
        self._channel_opened.pop(instance.address, None)
        super().evict(instance)

    def _opened(self, address: str, channel: TokenChannel) -> None:
        opened = self._channel_opened.get(address)
        if opened is not None and channel.streams_kv_events:
            opened.set()

    # one instance ------------------------------------------------------------------------------------
    async def _follow(self, instance: Instance) -> None:
        address = instance.address
        delay = self.retry_s
        while True:
            opened = self._channel_opened[address] = asyncio.Event()
            try:
                channel = self.client.token_channels.open_channel(address)
                if channel is not None and channel.streams_kv_events:
                    await self._follow_channel(address, channel)
                elif await self._follow_call(address, opened):
                    delay = self.retry_s
                    continue  # a channel opened: it takes over
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                    # An older worker: routed on its load alone; asked again later, in case it is upgraded in place.
                    logger.info("worker %s publishes no KV events: routed on its load alone", address)
                    self.index.drop(address)
                    await asyncio.sleep(UNIMPLEMENTED_RETRY_S)
                    continue
                logger.debug("KV events of %s: %s", address, exc.code().name)
            except EventsLost:
                logger.info("KV events of %s: some were lost; subscribing again", address)
            except Exception:  # noqa: BLE001 - the watch must outlive any one bad stream
                logger.exception("KV events of %s failed", address)
            if self.index.describe(address) is not None:  # it was followed until now: try again soon
                delay = self.retry_s
            self.index.drop(address)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_retry_s)

    async def _follow_call(self, address: str, opened: asyncio.Event) -> bool:
        """Follow a Watch call until it ends (False) or a token channel opens to take over (True)."""
        call = self.client.watch_kv_events(address)
        reader = asyncio.ensure_future(self._read_call(address, call, asyncio.current_task()))
        switch = asyncio.ensure_future(opened.wait())
        try:
            done, _ = await asyncio.wait((reader, switch), return_when=asyncio.FIRST_COMPLETED)
            if reader in done:
                reader.result()  # the call's failure, or its end (the worker drains)
                return False
            return True
        finally:
            call.cancel()
            reader.cancel()
            switch.cancel()
            await asyncio.gather(reader, switch, return_exceptions=True)

    async def _read_call(self, address: str, call, follower: asyncio.Task | None) -> None:
        apply = self.index.apply
        async for batch in call:
            if not self._current(address, follower):
                return
            if not apply(address, batch):
                raise EventsLost()

    async def _follow_channel(self, address: str, channel: TokenChannel) -> None:
        """Follow the events on the worker's token channel until it closes."""
        follower = asyncio.current_task()
        awaiting_reset = True  # until the snapshot asked for comes, batches still in flight are left alone

        def sink(batch: pb.KvEventBatch) -> None:
            nonlocal awaiting_reset
            if not self._current(address, follower):
                channel.kv_events_sink = None
                return
            if awaiting_reset and not batch.reset:
                return
            awaiting_reset = False
            if not self.index.apply(address, batch):
                logger.info("KV events of %s: some were lost; asking for a new snapshot", address)
                awaiting_reset = True
                channel.watch_kv_events(sink)

        channel.watch_kv_events(sink)
        try:
            await asyncio.shield(channel.closed)
        finally:
            channel.kv_events_sink = None  # a later subscription (routable again) asks for its own snapshot
