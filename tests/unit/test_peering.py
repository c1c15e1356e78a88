"""kopf's peering rule as peering.py applies it to the records kopf writes: which replica runs
passes. The whole failover runs on the real cluster in tests/e2e/test_operator_failover.py."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from accelerate_operator.peering import PeeringFollower, is_paused

NOW = datetime(2026, 11, 25, 12, 0, 0, tzinfo=timezone.utc)


def record(priority: int, seen_ago: float = 1.0, lifetime: int = 60) -> dict:
    """A record as kopf writes it (Peer.as_dict)."""
    return {"priority": priority, "lifetime": lifetime,
            "lastseen": (NOW - timedelta(seconds=seen_ago)).isoformat()}


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


def test_alone_or_before_its_own_record_a_replica_runs():
    assert not is_paused({}, "op@a/1/x", 0, NOW)
    assert not is_paused({"op@a/1/x": {"priority": 0}}, "op@a/1/x", 0, NOW)


def test_a_record_without_lastseen_counts_as_fresh_as_kopf_reads_it():
    assert is_paused({"op@a/1/x": {"priority": 9}}, "op@b/2/y", 0, NOW)


def test_the_follower_tells_each_change_once_across_all_peering_objects():
    told: list[bool] = []
    follower = PeeringFollower(read=lambda: None, identity="op@b/2/y", priority=-200,
                               on_change=told.append)
    active = {"op@b/2/y": record(-200)}
    follower.decide([active, {"op@a/1/x": record(-100), **active}], NOW)
    follower.decide([active, {"op@a/1/x": record(-100), **active}], NOW)
    follower.decide([active, {"op@a/1/x": record(-100, seen_ago=120), **active}], NOW)
    assert told == [True, False]
