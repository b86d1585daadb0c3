"""The leader's side of a group: a payload is applied only once every member staged it.

A fake member answers status as a member agent would; ``Group.ready`` returns only once
each member lists the name, and fails naming the member that failed, lost the attempt,
finished without the name or ran past the deadline. Without the wait, a worker pod's rank
would look for a file its agent had not staged yet.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from dcr.protocol.agent_api import AttemptSpec
from dcr.receiver.group import Group, GroupError
from dcr.receiver.member_api import MemberError, MemberStatus

NAME = "a-0000000000aa-o0000-s000000.dcrp"


def spec(deadline: float = 1e12) -> AttemptSpec:
    return AttemptSpec(attempt="a-0000000000aa", base_version=0, target_version=1,
                       mode="mixed", deadline=deadline)


class FakeMember:
    def __init__(self, url: str, answers: Callable[[int], MemberStatus]) -> None:
        self.url, self.answers, self.asked = url, answers, 0
        self.calls: list[str] = []

    def status(self, attempt: str) -> MemberStatus:
        self.asked += 1
        return self.answers(self.asked)

    def stage(self, s: AttemptSpec) -> MemberStatus:
        self.calls.append(f"stage {s.attempt}")
        return MemberStatus(name="m", attempt=s.attempt)

    def release(self, attempt: str, names: list[str]) -> MemberStatus:
        self.calls.append(f"release {names}")
        return MemberStatus(name="m", attempt=attempt)

    def end(self, attempt: str) -> MemberStatus:
        raise MemberError("member gone: no answer")


def staged_after(n: int) -> Callable[[int], MemberStatus]:
    return lambda asked: MemberStatus(name="m", attempt="a-0000000000aa",
                                      staged=[NAME] if asked >= n else [])


def test_ready_waits_until_every_member_has_staged_the_payload() -> None:
    slow, fast = FakeMember("http://w1", staged_after(4)), FakeMember("http://w2",
                                                                      staged_after(1))
    group = Group((slow, fast))  # type: ignore[arg-type]
    group.ready(spec(), NAME, threading.Event())
    assert (slow.asked, fast.asked) == (4, 1)  # it looked again until the slow one had it
    group.ready(spec(), NAME, threading.Event())  # seen already: no more calls
    assert (slow.asked, fast.asked) == (4, 1)
    group.release("a-0000000000aa", NAME)
    assert slow.calls == [f"release {[NAME]}"]
    group.end("a-0000000000aa")  # best effort: a member that is gone is only logged


@pytest.mark.parametrize(("answer", "match"), [
    (lambda _: MemberStatus(name="m", attempt="a-0000000000aa", error="ForeignPayload: x"),
     r"member http://w1 \(m\) failed: ForeignPayload: x"),
    (lambda _: MemberStatus(name="m", attempt="a-0000000000aa", received=True),
     "received the attempt without"),
])
def test_ready_fails_naming_a_member_that_failed_or_finished_without_it(
        answer: Callable[[int], MemberStatus], match: str) -> None:
    with pytest.raises(GroupError, match=match):
        Group((FakeMember("http://w1", answer),)).ready(  # type: ignore[arg-type]
            spec(), NAME, threading.Event())


def test_ready_fails_past_the_deadline_and_when_a_member_lost_the_attempt() -> None:
    never = FakeMember("http://w1", staged_after(10**9))
    t0 = time.monotonic()
    with pytest.raises(GroupError, match=r"had not staged .* by the attempt's deadline"):
        Group((never,)).ready(spec(time.time() + 0.3), NAME,  # type: ignore[arg-type]
                              threading.Event())
    assert time.monotonic() - t0 < 5

    def lost(_: int) -> MemberStatus:
        raise MemberError("member http://w1: status: attempt a-0000000000aa is not held "
                          "here (held: none)")

    with pytest.raises(GroupError, match="is not held here"):
        Group((FakeMember("http://w1", lost),)).ready(  # type: ignore[arg-type]
            spec(), NAME, threading.Event())


def test_a_stop_ends_the_wait_without_an_error() -> None:
    stop = threading.Event()
    stop.set()
    Group((FakeMember("http://w1", staged_after(10**9)),)).ready(  # type: ignore[arg-type]
        spec(), NAME, stop)
