"""Tests for spendguard.identity: ids are encoded injectively into short, key-safe strings."""

from __future__ import annotations

import pytest

from spendguard.identity import MAX_ENCODED_LEN, Identity, encode_id


def test_encoded_ids_are_safe_and_injective() -> None:
    raws = [
        "acme",
        "a:b",
        "a%3Ab",
        "a{b}",
        "a b",
        "a\nb",
        "é",
        "e\u0301",
        "x" * 10_000,
        "x" * 10_001,
    ]
    encoded = [encode_id(r) for r in raws]
    assert len(set(encoded)) == len(raws)
    for e in encoded:
        assert e and len(e) <= 96
        assert not set(e) & set("{}: \n\r\t")
    assert encode_id("acme") == "acme"  # plain ids stay readable in keys and SQL
    with pytest.raises(ValueError):
        encode_id("")
    with pytest.raises(ValueError):
        Identity("")


def test_identity_encodes_both_ids_and_keeps_the_raw_ones() -> None:
    ident = Identity("a:b", "k y")
    assert (ident.team_id, ident.api_key_id) == ("a:b", "k y")
    assert (ident.team, ident.api_key) == (encode_id("a:b"), encode_id("k y")) == ("a%3Ab", "k%20y")
    assert Identity("acme").api_key is None


@pytest.mark.parametrize("bad", [("acme", ""), (None, "k"), ("acme", 5), (5, None)])
def test_identity_refuses_empty_or_non_string_ids(bad: tuple[object, object]) -> None:
    with pytest.raises(ValueError):
        Identity(*bad)  # type: ignore[arg-type]


def test_long_ids_become_a_digest_that_no_plain_id_can_spell() -> None:
    long = encode_id("x" * (MAX_ENCODED_LEN + 1))
    assert long.startswith("~") and len(long) == 65
    assert encode_id("x" * MAX_ENCODED_LEN) == "x" * MAX_ENCODED_LEN  # at the bound: as is
    assert encode_id("~") == "%7E"  # a plain id never starts with the digest marker
