"""The health tracker both shared stores (Mooncake, S3) keep their state in."""

from __future__ import annotations

import logging

import pytest

from transfer.health import HealthTracker

COUNTERS = ("incidents", "errors", "skipped", "gets")


def tracker(ok: bool = True) -> HealthTracker:
    health = HealthTracker("test tier", COUNTERS, "not checked yet", logging.getLogger("t"))
    health.started(ok)
    return health


def test_a_store_starts_degraded_until_its_first_probe_answers() -> None:
    up, down = tracker(True), tracker(False)
    assert up.snapshot().ok
    assert up.snapshot().last_error is None
    assert up.counters["incidents"] == 0
    assert not down.snapshot().ok
    assert down.snapshot().last_error == "not checked yet"
    assert down.counters["incidents"] == 1


def test_every_key_failing_degrades_and_wakes_the_probe_some_keys_only_note_it() -> None:
    health = tracker()
    health.judge("get", 0, 4, "none")
    assert health.snapshot().ok
    assert health.counters["errors"] == 0
    health.judge("get", 1, 4, "codes [-1]")
    assert health.snapshot().ok
    assert health.snapshot().last_error == "get: 1 of 4 keys failed (codes [-1])"
    assert not health.wake.is_set()
    health.judge("get", 4, 4, "codes [-1]")
    snap = health.snapshot()
    assert not snap.ok
    assert snap.counters["incidents"] == 1
    assert snap.counters["errors"] == 2
    assert health.wake.is_set()
    health.fail("again")  # already degraded: the reason only, no second incident
    assert health.counters["incidents"] == 1
    assert health.snapshot().last_error == "again"


def test_a_degraded_store_holds_no_slot_and_counts_the_call_skipped() -> None:
    health = tracker()
    assert health.hold([3, 3, 5])
    assert health.held_slots() == {3, 5}
    health.release([3])
    assert health.held_slots() == {3, 5}  # 3 was held twice
    health.release([3, 5])
    assert health.held_slots() == frozenset()
    health.fail("down")
    assert not health.hold([7])
    assert health.held_slots() == frozenset()
    assert health.counters["skipped"] == 1


def test_recovery_and_close() -> None:
    health = tracker(False)
    health.recovered()
    assert health.snapshot().ok
    assert health.close()
    assert not health.close()  # once
    assert health.next_look(0.0) == (True, "ok")
    health.fail("late")  # a closed store's state no longer changes
    assert health.snapshot().ok
    assert not health.hold([])


@pytest.mark.parametrize("closed", [False, True])
def test_the_probe_wakes_at_once_when_woken(closed: bool) -> None:
    health = tracker()
    if closed:
        health.close()
    else:
        health.wake.set()
    assert health.next_look(30.0) == (closed, "ok")
    assert not health.wake.is_set()
