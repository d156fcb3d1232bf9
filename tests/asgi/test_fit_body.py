"""The output cap lowered in a request body byte for byte: only the cap's digits change."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from spendguard.asgi.fit import with_output_cap


def test_only_the_caps_digits_change() -> None:
    body = (
        b'{ "model" : "gpt-4o",\n  "messages":[{"role":"user","content":"max_tokens: 9000 \\" }"}],'
        b'"metadata":{"max_tokens":4000},"max_tokens" :\t4000 , "temperature":1.50E0,'
        b'"x_unknown":[1, {"a":null}], "caf\\u00e9":"\xc3\xa9"}'
    )
    got = with_output_cap(body, 1000)
    assert got == body.replace(b":\t4000 ,", b":\t1000 ,")
    assert json.loads(got)["metadata"] == {"max_tokens": 4000}  # nested: not the request's cap


def test_every_cap_field_above_it_is_lowered_and_none_below_or_null() -> None:
    body = b'{"max_completion_tokens":5000,"max_tokens":800,"max_output_tokens":null}'
    assert with_output_cap(body, 1000) == (
        b'{"max_completion_tokens":1000,"max_tokens":800,"max_output_tokens":null}'
    )
    assert with_output_cap(b'{"max_tokens":800}', 1000) is None
    assert with_output_cap(b'{"model":"m"}', 1000) is None


def test_an_escaped_key_is_still_the_cap() -> None:
    assert with_output_cap(b'{"max\\u005ftokens":4000}', 10) == b'{"max\\u005ftokens":10}'


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(
    st.dictionaries(st.text(max_size=6), _values, max_size=5),
    st.integers(1, 10**6),
    st.integers(0, 10**6),
    st.booleans(),
)
def test_any_body_keeps_everything_but_the_cap(
    fields: dict[str, object], cap: int, asked: int, ascii: bool
) -> None:
    fields = {k: v for k, v in fields.items() if k != "max_tokens"}
    body = json.dumps({**fields, "max_tokens": asked}, ensure_ascii=ascii, indent=1).encode()
    got = with_output_cap(body, cap)
    if asked <= cap:
        assert got is None
        return
    assert got is not None
    assert json.loads(got) == {**fields, "max_tokens": cap}
    assert len(got) == len(body) - len(str(asked)) + len(str(cap))
