"""The wire schema of protocol messages: decoded JSON checked against each field's type hint.

Every message and result is a frozen dataclass; its type hints are the schema. A schema is
compiled once per class (one check per field), because the coordinator decodes a message per
vote and ack of every rank. Two forms reach it:
- one message, a JSON object of its fields (`decode_fields`);
- a run of messages of one kind (`decode_run`): each field once, as a list of every message's
  value or, where they all agree, as one value for all. A node leader's `Bundle` carries its
  node's votes and acks this way: field names are read once per node rather than once per rank,
  what a node's ranks agree on (switch, digest, step) once per node, and a list of plain values
  is checked in one pass over the types it holds instead of one call per value.
Both forms raise `ProtocolError` naming the message kind, the field (and in a column the
position) and what was wrong, and build nothing when a value fails.
"""

from __future__ import annotations

import functools
import itertools
import json
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Any, Union


class ProtocolError(ValueError):
    """A message that is malformed, of an unknown kind, or not sealed with the job's token."""


# A check takes the decoded value and where it sits (the message's name and the field's path,
# joined only to word an error): a vote or ack is decoded per rank, so a value that passes
# formats no text and raises nothing.
Check = Callable[[Any, str, str], Any]
# A column check takes a list of one field's values and the same two names; returns the values.
ColumnCheck = Callable[[list, str, str], list]


class Schema(typing.NamedTuple):
    """A message class's wire schema, compiled once per class (`schema_of`)."""

    names: frozenset[str]
    """The field names."""
    tagged: frozenset[str]
    """The field names and "kind": every key a message's JSON object may hold."""
    build: Callable[[dict[str, Any]], Any]
    """The object of checked field values (`_builder_of`)."""
    fields: tuple[tuple[str, Check, ColumnCheck, frozenset[type]], ...]
    """Per field in declaration order: its value check, its column check, and the exact types
    of a value that its check returns unchanged (`_kept_for`): a value of one of those types is
    taken as it is, without a call (most fields of a vote or a summary are plain ints, strings
    and floats; two calls per field were a third of decoding one)."""


@functools.cache
def schema_of(cls: type) -> Schema:
    """A dataclass's schema, built once per class: resolving type hints costs ~100 us."""
    hints = typing.get_type_hints(cls)
    checks = tuple(
        (f.name, check_for(hint), _column_check_for(hint), _kept_for(hint))
        for f in fields(cls)
        for hint in (hints[f.name],)
    )
    names = frozenset(name for name, *_ in checks)
    return Schema(names, names | {"kind"}, _builder_of(cls), checks)


def _builder_of(cls: type) -> Callable[[dict[str, Any]], Any]:
    """`cls(**values)` for values of every field. A frozen dataclass's `__init__` sets each
    field through `object.__setattr__` (1.2 us for a vote summary's nine); a class with no
    `__post_init__` and a `__dict__` gets its fields in one update instead (0.24 us), which is
    what that `__init__` leaves behind when every field is given."""
    if hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"):
        return lambda values: cls(**values)

    def build(values: dict[str, Any]) -> Any:
        made = object.__new__(cls)
        made.__dict__.update(values)
        return made

    return build


def decode_fields(cls: type, d: Mapping[str, Any], what: str, *, strict: bool = True) -> Any:
    """`cls(**d)` with every field present and checked against its type hint; `strict`: and no
    other keys but "kind" (messages are strict; results ignore keys a newer peer adds)."""
    schema = schema_of(cls)
    if strict and not d.keys() <= schema.tagged:
        raise ProtocolError(f"{what}: unexpected fields {sorted(d.keys() - schema.tagged)}")
    return schema.build(_checked(schema, d, what))


def _checked(schema: Schema, d: Mapping[str, Any], what: str) -> dict[str, Any]:
    """Every field of `schema` from `d`, checked: a value whose exact type its check would keep
    as it is is taken without the call, any other goes through the check (which converts it or
    raises naming it), so both give what the check alone gives."""
    values = {}
    for name, check, _, kept in schema.fields:
        try:
            value = d[name]
        except KeyError:
            raise ProtocolError(f"{what}: missing field {name!r}") from None
        values[name] = value if type(value) in kept else check(value, what, name)
    return values


def decode_run(cls: type, run: Mapping[str, Any], what: str) -> list[Any]:
    """The `count` messages of class `cls` that `run` holds (the form `run_of` writes; its
    "kind" key is the caller's), each checked as `decode_fields` checks one: every field either
    in "each" (a list of `count` values, one per message) or in "same" (one value for all of
    them), never both, and no other field."""
    if not run.keys() <= _RUN_KEYS:
        raise ProtocolError(f"{what}: unexpected keys {sorted(run.keys() - _RUN_KEYS)} in a run")
    count, each, same = run.get("count"), run.get("each"), run.get("same")
    if type(count) is not int or not 1 <= count <= MAX_RUN:
        raise ProtocolError(
            f"{what}.count: expected the number of messages (1 to {MAX_RUN}), got {count!r}"
        )
    if type(each) is not dict or type(same) is not dict:
        raise ProtocolError(f"{what}: a run's 'each' and 'same' must be JSON objects")
    schema = schema_of(cls)
    if not (each.keys() <= schema.names and same.keys() <= schema.names):
        raise ProtocolError(
            f"{what}: unexpected fields {sorted((each.keys() | same.keys()) - schema.names)}"
        )
    if not each:  # a node's summary: one message, every field once
        values_of_all = _checked(schema, same, what)
        return [schema.build(values_of_all) for _ in range(count)]
    values: list[Any] = []
    for name, check, check_column, kept in schema.fields:
        if name in each:
            if name in same:
                raise ProtocolError(f"{what}.{name}: both per message and the same for all")
            column = each[name]
            if type(column) is not list or len(column) != count:
                got = f"{len(column)} values" if type(column) is list else type(column).__name__
                raise ProtocolError(f"{what}.{name}: expected a list of {count} values, got {got}")
            values.append(check_column(column, what, name))
        elif name in same:
            value = same[name]
            values.append(
                itertools.repeat(value if type(value) in kept else check(value, what, name), count)
            )
        else:
            raise ProtocolError(f"{what}: missing field {name!r}")
    return list(map(cls, *values))


def run_of(messages: Sequence[Any]) -> dict[str, Any]:
    """Messages of one class as a run: their count, and each field either as one value for all
    (where every message's value has the same JSON text, so the reader decodes what it would
    from each message) or as a list of every message's value. The values are shared, not
    copied; a field "same" for all is, after decoding, one object shared by the messages."""
    if len(messages) == 1:  # a node's summary: every field is its own, with nothing to compare
        return {"count": 1, "each": {}, "same": fields_of(messages[0])}
    each: dict[str, list] = {}
    same: dict[str, Any] = {}
    for name in _field_order(type(messages[0])):
        column = [getattr(m, name) for m in messages]
        if len({json.dumps(v, sort_keys=True) for v in column}) == 1:
            same[name] = column[0]
        else:
            each[name] = column
    return {"count": len(messages), "each": each, "same": same}


_RUN_KEYS = frozenset({"kind", "count", "each", "same"})
# A run whose every field is "same" is as long as its count says, not as its text: a bound keeps
# a few bytes from asking for millions of messages (a node leader sends at most 4,096 per bundle).
MAX_RUN = 65_536


def fields_of(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict, its values shared, not copied (`dataclasses.asdict` deep
    copies: a result carrying one entry per rank cost ~60 us per rank at 16k ranks). The values
    are plain JSON data of a frozen object; callers build new dicts around them."""
    return {name: getattr(obj, name) for name in _field_order(type(obj))}


@functools.cache
def _field_order(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _mismatch(value: Any, hint: Any, what: str, path: str) -> ProtocolError:
    return ProtocolError(
        f"{what}.{path}: expected {getattr(hint, '__name__', hint)}, got {value!r}"
    )


@functools.cache
def check_for(hint: Any) -> Check:
    """The check (and conversion: JSON object keys to int) of decoded JSON against a type hint."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if all(option in _SCALARS for option in options):  # `int | None`: no trial and error
            accepts = tuple(_SCALARS[option] for option in options)
            floats = float in options

            def check_scalar_union(value: Any, what: str, path: str) -> Any:
                for accept in accepts:
                    if accept(value):
                        return float(value) if floats and accept is _SCALARS[float] else value
                raise ProtocolError(f"{what}.{path}: {value!r} does not match {hint}")

            return check_scalar_union
        checks = tuple(check_for(option) for option in options)

        def check_union(value: Any, what: str, path: str) -> Any:
            for check in checks:
                try:
                    return check(value, what, path)
                except ProtocolError:
                    continue
            raise ProtocolError(f"{what}.{path}: {value!r} does not match {hint}")

        return check_union
    if origin is dict:
        key_t, val_t = typing.get_args(hint)
        check_val = check_for(val_t)

        def check_dict(value: Any, what: str, path: str) -> Any:
            if not isinstance(value, dict):
                raise _mismatch(value, hint, what, path)
            out = {}
            for k, v in value.items():
                try:
                    key = int(k) if key_t is int else k
                except ValueError:
                    raise ProtocolError(f"{what}.{path}: key {k!r} is not an integer") from None
                out[key] = check_val(v, what, f"{path}[{k}]")
            return out

        return check_dict
    if origin is tuple:
        (item_t, _) = typing.get_args(hint)
        check_item = check_for(item_t)

        def check_tuple(value: Any, what: str, path: str) -> Any:
            if not isinstance(value, (list, tuple)):
                raise _mismatch(value, hint, what, path)
            item_path = f"{path}[]"
            return tuple(check_item(v, what, item_path) for v in value)

        return check_tuple
    accept = _SCALARS.get(hint)
    if accept is None:
        raise TypeError(f"protocol bug: no wire check for type hint {hint!r}")

    if hint is float:

        def check_float(value: Any, what: str, path: str) -> Any:
            if not accept(value):
                raise _mismatch(value, hint, what, path)
            return float(value)

        return check_float

    def check_scalar(value: Any, what: str, path: str) -> Any:
        if not accept(value):
            raise _mismatch(value, hint, what, path)
        return value

    return check_scalar


# type hint -> does a decoded JSON value qualify (bools are not numbers on the wire)
_SCALARS: dict[Any, Callable[[Any], bool]] = {
    type(None): lambda v: v is None,
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    dict: lambda v: isinstance(v, dict),
}

# type hint -> the exact types of a value that its check returns unchanged (a float field's int
# is converted, so it is not here). Decoded JSON holds no subclasses, and a value of any other
# type takes the value-by-value check, which converts it or names it.
_KEPT: dict[Any, frozenset[type]] = {
    type(None): frozenset({type(None)}),
    bool: frozenset({bool}),
    int: frozenset({int}),
    float: frozenset({float}),
    str: frozenset({str}),
    dict: frozenset({dict}),
}


def _kept_for(hint: Any) -> frozenset[type]:
    """The exact types of a value that the check of `hint` returns unchanged: for a scalar hint
    (or a union of them) those of `_KEPT`; none for any other hint, whose check builds a value
    (a dict with int keys, a tuple), and none for a union with float, which may turn an int
    into a float or keep it by the options' order."""
    union = typing.get_origin(hint) in (Union, types.UnionType)
    options = typing.get_args(hint) if union else (hint,)
    if not all(option in _KEPT for option in options) or (union and float in options):
        return frozenset()
    return frozenset().union(*(_KEPT[option] for option in options))


def _column_check_for(hint: Any) -> ColumnCheck:
    """The check of a column of `hint` values: for a scalar hint (or a union of them), one pass
    over the set of the values' types (`set(map(type, ...))` runs in C) that returns the column
    itself when every value would come back unchanged; otherwise, and for any other hint, the
    value check of each in turn, which converts or raises naming the value's position."""
    check = check_for(hint)

    def check_each(column: list, what: str, path: str) -> list:
        return [check(v, what, f"{path}[{i}]") for i, v in enumerate(column)]

    kept = _kept_for(hint)
    if not kept:
        return check_each

    def check_column(column: list, what: str, path: str) -> list:
        if set(map(type, column)) <= kept:
            return column
        return check_each(column, what, path)

    return check_column
