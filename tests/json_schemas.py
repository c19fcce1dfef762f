"""Bounded JSON schemas for structured-output tests, drawn by hypothesis, and their instances:
every output a schema allows is at most `max_bytes` long (no free whitespace), so an output that
does not stop on its own is a bug.

Schemas: objects (every property required, no other) of strings with maxLength, integer ranges,
booleans, nulls, enums of short words, arrays of those with maxItems, one level of nesting.
"""
import json

from hypothesis import strategies as st

NAMES = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)
LEAVES = st.one_of(
    st.integers(0, 8).flatmap(lambda n: st.fixed_dictionaries(
        {"type": st.just("string"), "maxLength": st.just(n)},
        optional={"minLength": st.integers(0, n)})),
    st.tuples(st.integers(-1000, 1000), st.integers(0, 1000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=4,
             unique=True).map(lambda values: {"enum": values}),
)
ARRAYS = st.tuples(LEAVES, st.integers(0, 3)).flatmap(lambda t: st.fixed_dictionaries(
    {"type": st.just("array"), "items": st.just(t[0]), "maxItems": st.just(t[1])},
    optional={"minItems": st.integers(0, t[1])}))


def objects(values: st.SearchStrategy) -> st.SearchStrategy:
    return st.dictionaries(NAMES, values, min_size=1, max_size=3).map(lambda props: {
        "type": "object", "properties": props, "required": sorted(props),
        "additionalProperties": False})


def max_bytes(schema: dict) -> int:
    """The longest JSON text the schema allows without free whitespace: a string character
    takes at most 4 bytes, and a token at least one."""
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return 2 + 4 * schema["maxLength"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind in ("boolean", "null"):
        return 5
    if kind == "array":
        n = schema["maxItems"]
        return 2 + n * max_bytes(schema["items"]) + 2 * max(n - 1, 0)
    props = schema["properties"]
    return 2 + sum(len(json.dumps(k)) + 2 + max_bytes(v) for k, v in props.items()) \
        + 2 * (len(props) - 1)


def instances(schema: dict) -> st.SearchStrategy:
    """Values the schema allows, strings with no character JSON would escape (xgrammar's
    length-bounded strings hold no escape)."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema["type"]
    if kind == "string":
        chars = st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters='"\\')
        return st.text(chars, min_size=schema.get("minLength", 0), max_size=schema["maxLength"])
    if kind == "integer":
        return st.integers(schema["minimum"], schema["maximum"])
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(instances(schema["items"]), min_size=schema.get("minItems", 0),
                        max_size=schema["maxItems"])
    return st.fixed_dictionaries({k: instances(v) for k, v in schema["properties"].items()})


def compact(value, schema: dict) -> str:
    """JSON as the schema's grammar without free whitespace writes it: properties in the
    schema's order, ", " and ": " between tokens."""
    return json.dumps(_ordered(value, schema), separators=(", ", ": "), ensure_ascii=False)


def _ordered(value, schema: dict):
    if isinstance(value, dict):
        return {k: _ordered(value[k], s) for k, s in schema["properties"].items()}
    if isinstance(value, list):
        return [_ordered(v, schema["items"]) for v in value]
    return value
