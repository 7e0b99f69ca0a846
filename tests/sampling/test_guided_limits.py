"""Guided-decoding constraints larger or deeper than the MAX_GUIDED_* bounds are refused with a 400 that names
the bound, before any compiler sees them; constraints at the bounds pass."""

from __future__ import annotations

import json

import pytest

from heron.errors import InvalidRequestError
from heron.sampling_params import MAX_GUIDED_BYTES, MAX_GUIDED_DEPTH, MAX_SCHEMA_REFS, GuidedDecodingParams


def nested_schema(levels: int) -> dict:
    """A schema whose JSON nests ``levels`` objects deep."""
    schema: dict = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


def ref_schema(refs: int) -> dict:
    return {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(refs)}, "$ref": "#/$defs/d0"}


def padded_schema(size: int) -> dict:
    """A schema of exactly ``size`` bytes as compact JSON."""
    frame = len(json.dumps({"type": "string", "description": ""}, separators=(",", ":")))
    return {"type": "string", "description": "é" * ((size - frame) // 2) + "x" * ((size - frame) % 2)}


@pytest.mark.parametrize("kwargs, param, message", [
    (dict(json=padded_schema(MAX_GUIDED_BYTES + 1)), "guided_json",
     f"guided_json is {MAX_GUIDED_BYTES + 1} bytes; the limit is {MAX_GUIDED_BYTES}"),
    (dict(json=json.dumps(padded_schema(MAX_GUIDED_BYTES + 1))), "guided_json", "the limit is 65536"),
    (dict(json=nested_schema(MAX_GUIDED_DEPTH + 1)), "guided_json", "guided_json nests deeper than 64 levels"),
    (dict(json="[" * 100_000 + "]" * 100_000), "guided_json", "guided_json nests deeper than 64 levels"),
    (dict(json=ref_schema(MAX_SCHEMA_REFS + 1)), "guided_json", "guided_json has 1002 $refs; the limit is 1000"),
    (dict(regex="a" * (MAX_GUIDED_BYTES + 1)), "guided_regex", "the limit is 65536"),
    (dict(regex="(" * 65 + "a" + ")" * 65), "guided_regex", "guided_regex nests deeper than 64 levels"),
    (dict(grammar="root ::= " + "(" * 65 + '"a"' + ")" * 65), "guided_grammar", "nests deeper than 64 levels"),
    (dict(grammar='root ::= "' + "a" * MAX_GUIDED_BYTES + '"'), "guided_grammar", "the limit is 65536"),
    (dict(choice=["a" * 40_000, "b" * 30_000]), "guided_choice", "guided_choice is 70000 bytes"),
])
def test_constraints_past_the_bounds_are_refused(kwargs, param, message):
    with pytest.raises(InvalidRequestError) as err:
        GuidedDecodingParams(**kwargs)
    assert err.value.param == param and message in str(err.value)


@pytest.mark.parametrize("kwargs", [
    dict(json=padded_schema(MAX_GUIDED_BYTES)),
    dict(json=nested_schema(MAX_GUIDED_DEPTH)),
    dict(json=ref_schema(MAX_SCHEMA_REFS - 1)),  # and the root's $ref: 1000
    dict(regex="(" * 64 + "a" + ")" * 64),
    dict(regex=r"\(" * 100 + "[(]" * 100),  # escaped and bracketed parentheses do not nest
    dict(grammar='root ::= "' + "(" * 100 + '" [(]'),  # nor do those in literals
])
def test_constraints_at_the_bounds_pass(kwargs):
    GuidedDecodingParams(**kwargs)
