"""kopf's peering rule as peering.py applies it to the records kopf writes, and the follower that
pauses a replica which cannot confirm that it is the active one (no split-brain). The follower
runs on a real event loop with its timings scaled down; a replica cut off from the peering object
on the real cluster is tests/integration/test_operator_cut_off.py, the whole failover
tests/e2e/test_operator_failover.py."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

import pytest
from accelerate_operator import peering
from accelerate_operator.peering import PeeringFollower, active_for, is_paused

NOW = datetime(2026, 11, 25, 12, 0, 0, tzinfo=timezone.utc)
ME = "op@b/2/y"


def record(priority: int, seen_ago: float = 1.0, lifetime: int = 60,
           now: datetime = NOW) -> dict:
    """A record as kopf writes it (Peer.as_dict)."""
    return {"priority": priority, "lifetime": lifetime,
            "lastseen": (now - timedelta(seconds=seen_ago)).isoformat()}


# ---- kopf's rule --------------------------------------------------------------------------------
def test_the_replica_of_highest_priority_runs_and_the_others_pause():
    records = {"op@a/1/x": record(-100), "op@b/2/y": record(-200)}
    assert not is_paused(records, "op@a/1/x", -100, NOW)
    assert is_paused(records, "op@b/2/y", -200, NOW)


def test_a_dead_replica_no_longer_pauses_the_others():
    records = {"op@a/1/x": record(-100, seen_ago=61), "op@b/2/y": record(-200)}
    assert not is_paused(records, "op@b/2/y", -200, NOW)


def test_two_live_replicas_of_the_same_priority_both_pause():
    records = {"op@a/1/x": record(5), "op@b/2/y": record(5)}
    assert is_paused(records, "op@a/1/x", 5, NOW)
    assert is_paused(records, "op@b/2/y", 5, NOW)


def test_a_record_without_lastseen_counts_as_fresh_as_kopf_reads_it():
    assert is_paused({"op@a/1/x": {"priority": 9}}, ME, 0, NOW)


# ---- how long a read confirms this replica ------------------------------------------------------
def test_a_read_that_shows_this_replica_active_confirms_it_for_the_grace():
    assert active_for([{ME: record(0)}], ME, 0, NOW) == peering.GRACE_SECONDS


def test_an_own_record_about_to_end_confirms_only_until_its_end_less_the_margin():
    # Seen 55 s ago with a 60 s lifetime: the peers count this replica dead in 5 s.
    assert active_for([{ME: record(0, seen_ago=55)}], ME, 0, NOW) == pytest.approx(
        5 - peering.MARGIN_SECONDS)
    assert active_for([{ME: record(0, seen_ago=59)}], ME, 0, NOW) == 0


def test_without_its_own_live_record_a_replica_does_not_act():
    """The others do not know it: any of them may be active too."""
    assert active_for([{}], ME, 0, NOW) == 0
    assert active_for([{ME: {"priority": 0}}], ME, 0, NOW) == 0
    assert active_for([{ME: record(0, seen_ago=61)}], ME, 0, NOW) == 0


def test_every_peering_object_must_confirm_it():
    mine = {ME: record(0)}
    assert active_for([mine, mine], ME, 0, NOW) == peering.GRACE_SECONDS
    assert active_for([mine, {**mine, "op@a/1/x": record(7)}], ME, 0, NOW) == 0
    assert active_for([mine, {}], ME, 0, NOW) == 0


def test_the_follower_tells_each_change_once_across_all_peering_objects():
    async def scenario() -> list[bool]:
        told: list[bool] = []
        follower = PeeringFollower(read=None, identity=ME, priority=-200, on_change=told.append,
                                   now=lambda: NOW)
        active = {ME: record(-200)}
        follower.decide([active, {"op@a/1/x": record(-100), **active}], NOW)
        follower.decide([active, {"op@a/1/x": record(-100), **active}], NOW)
        follower.decide([active, {"op@a/1/x": record(-100, seen_ago=120), **active}], NOW)
        follower.decide([active, active], NOW)
        return told

    assert asyncio.run(scenario()) == [True, False]


# ---- the follower on a real loop, timings scaled down -------------------------------------------
@pytest.fixture
def fast(monkeypatch):
    """Poll every 20 ms; an answer stands 0.3 s; stop 0.5 s before the own record ends."""
    monkeypatch.setattr(peering, "POLL_SECONDS", 0.02)
    monkeypatch.setattr(peering, "READ_TIMEOUT_SECONDS", 0.1)
    monkeypatch.setattr(peering, "GRACE_SECONDS", 0.3)
    monkeypatch.setattr(peering, "MARGIN_SECONDS", 0.5)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Peering:
    """A peering object shared by replicas, and kopf's keep-alive of each (a touch)."""

    def __init__(self) -> None:
        self.records: dict[str, dict] = {}
        self.cut: set[str] = set()  # replicas that can neither read nor write it

    def touch(self, identity: str, priority: int, lifetime: int = 2) -> None:
        if identity not in self.cut:
            self.records[identity] = record(priority, seen_ago=0, lifetime=lifetime,
                                            now=utcnow())

    def reader(self, identity: str, hang: bool = False):
        async def read() -> list[dict]:
            if identity in self.cut:
                if hang:
                    await asyncio.sleep(3600)
                raise PermissionError("403: cannot get kopfpeerings")
            return [{k: dict(v) for k, v in self.records.items()}]
        return read


async def follow(follower: PeeringFollower, seconds: float, every: float = 0.01,
                 each=lambda: None) -> list:
    """Run the follower for `seconds`, calling `each` every `every` seconds."""
    task = asyncio.create_task(follower.run())
    try:
        for _ in range(int(seconds / every)):
            each()
            await asyncio.sleep(every)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("hang", [False, True], ids=["read refused", "read hangs"])
def test_a_replica_that_cannot_read_the_peering_object_pauses_within_the_grace(fast, hang):
    async def scenario() -> tuple[list[bool], float | None]:
        shared, told, paused_at = Peering(), [], {}
        follower = PeeringFollower(shared.reader(ME, hang), ME, 0, told.append)
        shared.touch(ME, 0, lifetime=60)
        await follow(follower, 0.2)
        assert told == [False]
        cut_at = asyncio.get_running_loop().time()
        shared.cut.add(ME)

        def note() -> None:
            if follower.paused and "at" not in paused_at:
                paused_at["at"] = asyncio.get_running_loop().time() - cut_at
        await follow(follower, 0.6, each=note)
        shared.cut.clear()
        await follow(follower, 0.2)
        return told, paused_at.get("at")

    told, paused_after = asyncio.run(scenario())
    assert told == [False, True, False]  # paused once cut off, resumed once it reads again
    assert paused_after is not None and paused_after <= 0.3 + 0.25


def test_a_replica_whose_record_is_not_renewed_pauses_before_the_others_may_take_over(fast):
    """Reads work but kopf cannot write its keep-alive: the own record ages towards its end."""
    async def scenario() -> list[bool]:
        shared, told = Peering(), []
        follower = PeeringFollower(shared.reader(ME), ME, 0, told.append)
        shared.touch(ME, 0, lifetime=1)
        await follow(follower, 0.15)
        assert told == [False]
        await follow(follower, 0.6)  # the record ends 1 s after its touch; the margin is 0.5 s
        return told

    told = asyncio.run(scenario())
    # Running, then paused for good before the record ends. A starved event loop may also pause
    # and resume in between (a read later than the grace): what must hold is the end.
    assert told[0] is False and told[-1] is True, told


def test_the_replica_cut_off_stops_before_the_other_one_starts(fast):
    """Two replicas over one peering object, each kept alive as kopf does (every 0.5 s, records
    of 2 s). The active one is cut off (no read, no write); the standby takes over once the cut
    replica's record has ended, and at no moment are both running."""
    async def scenario() -> tuple[list[tuple[bool, bool]], float]:
        shared = Peering()
        a = PeeringFollower(shared.reader("a"), "a", 200, lambda paused: None)
        b = PeeringFollower(shared.reader("b"), "b", 100, lambda paused: None)
        seen: list[tuple[bool, bool]] = []
        loop = asyncio.get_running_loop()
        last_touch = [loop.time() - 1.0]

        def step() -> None:
            if loop.time() - last_touch[0] >= 0.5:
                shared.touch("a", 200)
                shared.touch("b", 100)
                last_touch[0] = loop.time()
            seen.append((a.paused is False, b.paused is False))

        tasks = [asyncio.create_task(follow(b, 4.5, each=step))]
        await asyncio.sleep(0.3)
        assert (a.paused, b.paused) == (None, True)  # a is not following yet
        tasks.append(asyncio.create_task(follow(a, 1.0)))
        await tasks[1]  # a ran for 1 s, then is cut off (its follower stops with it)
        shared.cut.add("a")
        a_task = asyncio.create_task(follow(a, 3.0))
        await asyncio.gather(tasks[0], a_task)
        return seen, (a.paused, b.paused)

    seen, final = asyncio.run(scenario())
    assert (True, False) in seen  # a was active, b standing by
    assert (True, True) not in seen  # never both
    assert final == (True, False)  # b took over, a stays paused
