"""Every fleet's status poll on its own schedule, at most one refresh of a fleet at a time.

A refresh calls the fleet's agents, so it takes as long as its slowest agent allows (a
status call's deadline, a catch-up's dense load). Polling every fleet together, round by
round, would let one slow fleet hold every other's status back; refreshing on each spec
update beside the poll would let updates pile threads up behind one slow agent. So each
fleet has its own task (refresh, then wait ``interval_s``), every refresh of a fleet (its
poll's and its handlers') waits for the one in flight, and refreshes run on their own
threads, never on the event loop's default executor that refits use.
docs/operator.md, "Inside the operator"; docs/security-kubernetes.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

FleetKey = tuple[str, str]  # (namespace, name)
# Fleets refreshed at once: past this many slow ones, the next waits for a thread.
POLL_THREADS = 256


class FleetPolls:
    """The poll tasks of the fleets that exist; ``refresh(namespace, name)`` (blocking)
    refreshes one, ``forget(fleets)`` drops what is kept of fleets no longer listed."""

    def __init__(self, refresh: Callable[[str, str], None], *, interval_s: float,
                 forget: Callable[[set[FleetKey]], Any] = lambda _: None,
                 threads: int = POLL_THREADS) -> None:
        self._refresh, self.interval_s, self._forget = refresh, interval_s, forget
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="fleet-poll")
        self._tasks: dict[FleetKey, asyncio.Task[None]] = {}
        self._running: dict[FleetKey, asyncio.Future[Any]] = {}

    async def run_one(self, key: FleetKey, fn: Callable[[], Any] | None = None) -> Any:
        """``fn`` (default: the fleet's refresh) on a poll thread once no other refresh
        of the fleet is in flight; its result or its exception. A caller that is
        cancelled leaves the refresh running, and the next one still waits for it."""
        busy = self._running.get(key)
        while busy is not None and not busy.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(busy)
            busy = self._running.get(key)
        call = fn or functools.partial(self._refresh, *key)
        future = asyncio.get_running_loop().run_in_executor(self._pool, call)
        self._running[key] = future  # no await since the check: nobody else started one
        future.add_done_callback(functools.partial(self._finished, key))
        return await asyncio.shield(future)

    def _finished(self, key: FleetKey, future: asyncio.Future[Any]) -> None:
        if self._running.get(key) is future:
            del self._running[key]

    async def _poll(self, key: FleetKey) -> None:
        while True:
            try:
                await self.run_one(key)
            except Exception as e:  # the next round tries again
                log.warning("RolloutFleet %s/%s: status not refreshed: %s", *key, e)
            await asyncio.sleep(self.interval_s)

    def sync(self, fleets: Iterable[FleetKey]) -> None:
        """Start the polls of fleets new to the list, stop those of fleets gone from it."""
        now = set(fleets)
        for key in now - set(self._tasks):
            self._tasks[key] = asyncio.create_task(self._poll(key), name=f"poll {key}")
        for key in set(self._tasks) - now:
            self._tasks.pop(key).cancel()
        self._forget(now)

    def polling(self) -> set[FleetKey]:
        return set(self._tasks)

    async def run(self, fleets: Callable[[], Iterable[FleetKey]]) -> None:
        """Every ``interval_s``, match the polls to ``fleets()``, until cancelled."""
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                self.sync(fleets())
        finally:
            self.close()

    def close(self) -> None:
        """Stop every poll; refreshes in flight end by their own deadlines."""
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
