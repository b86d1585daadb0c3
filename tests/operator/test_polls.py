"""Fleet polls: each fleet on its own schedule, one refresh of a fleet at a time.

A fleet whose agent answers slowly (a byte at a time, within every read timeout) must
hold back only its own status: the other fleets are refreshed at their own pace, and
refreshes asked for the slow fleet (its spec updated again and again) wait for the one in
flight instead of taking a thread each.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from typing import Any

from stubs import stubs

from dcr.protocol.agent_api import AgentClient, AgentError
from dcr_operator.polls import FleetPolls

TOKEN = "poll-test-token-0123456789abcdef"
STATUS = {"name": "r0", "version": 1, "dirty": None, "unknown": None, "attempt": None,
          "state": None, "error": None, "gate_open": True, "payloads_staged": 0,
          "payloads_applied": 0, "bytes_staged": 0}
SLOW, VICTIM = ("team-a", "slow"), ("team-b", "victim")


class Fleets:
    """Refreshes that ask each fleet's one agent for its status, counted."""

    def __init__(self, clients: dict[tuple[str, str], AgentClient]) -> None:
        self.clients = clients
        self.done: collections.Counter[str] = collections.Counter()
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.most: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def refresh(self, namespace: str, name: str) -> None:
        with self._lock:
            self.in_flight[name] += 1
            self.most[name] = max(self.most[name], self.in_flight[name])
        try:
            self.clients[namespace, name].status()
        except AgentError:
            pass
        finally:
            with self._lock:
                self.in_flight[name] -= 1
                self.done[name] += 1


async def until(condition: Any, bound_s: float = 60.0) -> None:
    """Wait for ``condition()``; fail after ``bound_s`` (an outcome, not a timing)."""
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(poll(), bound_s)


def test_a_victim_fleet_keeps_being_refreshed_while_another_fleets_agent_trickles() -> None:
    """Fails with one poll round for every fleet (the round gathered every fleet's refresh
    before the next), as the operator polled: the victim was refreshed once, then waited
    for the slow fleet's agent. Here that agent trickles its status a byte every 50 ms
    under a 600 s deadline, and the victim is refreshed 20 times meanwhile; 50 spec
    updates of the slow fleet wait for its refresh in flight, taking no thread."""
    fleets = Fleets({})
    forgotten: list[set[tuple[str, str]]] = []

    async def main() -> None:
        polls = FleetPolls(fleets.refresh, interval_s=0.01, forget=forgotten.append)
        with stubs("127.0.0.2", "127.0.0.3") as (slow, fine):
            slow.answer = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n{"
            slow.trickle_s = 0.05
            fine.answer = (200, {"Content-Type": "application/json"},
                           json.dumps(STATUS).encode())
            fleets.clients = {SLOW: AgentClient("r0", slow.url, TOKEN, timeout_s=600),
                              VICTIM: AgentClient("r0", fine.url, TOKEN, timeout_s=600)}
            polls.sync([SLOW, VICTIM])
            await until(lambda: fleets.in_flight["slow"] == 1)
            updates = [asyncio.create_task(polls.run_one(SLOW)) for _ in range(50)]
            await until(lambda: fleets.done["victim"] >= 20)
            assert fleets.done["slow"] == 0  # still trickling
            assert fleets.most["slow"] == 1  # the updates wait; no thread each
            assert not any(u.done() for u in updates)
            # The event loop's default executor is free for everything else.
            assert await asyncio.to_thread(lambda: "free") == "free"
            polls.sync([VICTIM])  # the slow fleet deleted: its poll stops
            assert polls.polling() == {VICTIM}
            assert forgotten[-1] == {VICTIM}
            for u in updates:
                u.cancel()
            await asyncio.gather(*updates, return_exceptions=True)
            polls.close()
        await until(lambda: fleets.done["slow"] == 1)  # the stub stopped: the call ended

    asyncio.run(main())
    assert fleets.most["victim"] == 1
