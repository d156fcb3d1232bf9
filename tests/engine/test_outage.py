"""Tests for spendguard.engine.outage: what a process allowed while the store was down, bounded,
said out loud and forgotten once the store answers again."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY

from spendguard.engine.outage import OutageTracker
from spendguard.identity import Identity

ALPHA, BETA, TEAM = Identity("acme", "alpha"), Identity("acme", "beta"), Identity("acme")


def tracked_gauge() -> float | None:
    return REGISTRY.get_sample_value("spendguard_fail_open_tracked_identities")


def test_admits_new_identities_up_to_its_bound_and_known_ones_always() -> None:
    tracker = OutageTracker(max_keys=2)
    assert tracker.admit(ALPHA) and tracker.admit(TEAM)  # a team alone is its own identity
    assert not tracker.admit(BETA)  # full: a new identity is refused, never allowed untracked
    assert tracker.admit(ALPHA)  # one already tracked keeps being counted
    assert len(tracker) == 2
    assert tracker.spent(ALPHA) == (2, 0) and tracker.spent(BETA) == (0, 0)


def test_charges_add_up_per_identity_and_untracked_ones_are_ignored() -> None:
    tracker = OutageTracker(max_keys=10)
    tracker.admit(ALPHA)
    tracker.charge(ALPHA, 15)
    tracker.charge(ALPHA, 7)
    tracker.charge(BETA, 99)  # never admitted during this outage
    assert tracker.spent(ALPHA) == (1, 22)
    assert tracker.spent(BETA) == (0, 0) and len(tracker) == 1


def test_identities_are_told_apart_by_their_encoded_ids() -> None:
    tracker = OutageTracker(max_keys=10)
    tracker.admit(Identity("a:b", "k"))
    assert tracker.spent(Identity("a:b", "k")) == (1, 0)
    assert tracker.spent(Identity("a%3Ab", "k")) == (0, 0)


def test_clear_says_what_the_outage_let_through_then_forgets_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tracker = OutageTracker(max_keys=10)
    for identity, micros in ((ALPHA, 15), (ALPHA, 15), (BETA, 5)):
        tracker.admit(identity)
        tracker.charge(identity, micros)
    caplog.set_level(logging.WARNING, "spendguard")
    tracker.clear()
    assert len(tracker) == 0 and tracker.spent(ALPHA) == (0, 0)
    [message] = [r.getMessage() for r in caplog.records]
    assert "3 requests of 2 identities" in message and "35 micro-USD" in message
    caplog.clear()
    tracker.clear()  # nothing tracked: nothing to say
    assert caplog.records == []
    assert tracker.admit(BETA)  # room again after the outage


def test_the_gauge_counts_tracked_identities() -> None:
    tracker = OutageTracker(max_keys=10)
    tracker.admit(ALPHA)
    tracker.admit(BETA)
    assert tracked_gauge() == 2
    tracker.clear()
    assert tracked_gauge() == 0
