"""Typed op contracts: every node op's request (and, where callers read it, its answer) as a
frozen dataclass, checked once when it comes off the wire.

A request type names its op in `OP` and declares its fields with their types; `from_wire`
turns a JSON object into a checked instance (types, ranges, names) or raises InvalidArgument
in one line that names the op and the field, so a handler only ever sees checked values.
`to_wire` is what a caller sends. The modules of this package hold the types of one owner
each (`contract.preload` for the preload's ops, ...): an op's request type and its owner are
found by its module's name.

Field types understood: bool, int, float, str, Any, `X | None`, `list[X]`, `dict[str, X]`,
`Literal[...]` and nested Wire types (sent as JSON objects). Further checks come from the
field's metadata: `at_least(n)`, `dataset_name()`, `checked(fn)`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, Self, Union, get_args, get_origin

from kspeedfs.format.errors import InvalidArgument
from kspeedfs.format.names import validate_name

_CHECK = "kspeedfs.check"  # the metadata key of a field's extra check
_MISSING: Any = dataclasses.MISSING


class _Bad(Exception):
    """A field's value refused; becomes one InvalidArgument naming the op and the field."""


def checked(check: Callable[[Any], Any], default: Any = _MISSING) -> Any:
    """A field whose value, once of the right type, also passes `check` (which returns the
    value to keep, or raises InvalidArgument or ValueError with the reason)."""
    return dataclasses.field(default=default, metadata={_CHECK: check})


def at_least(minimum: int | float, default: Any = _MISSING) -> Any:
    """A number field (or list of numbers) of at least `minimum`; None passes, for an
    optional field."""

    def check(value: Any) -> Any:
        values = value if isinstance(value, list) else [] if value is None else [value]
        for v in values:
            if v < minimum:
                raise _Bad(f"must be at least {minimum}, not {v}")
        return value

    return checked(check, default)


def dataset_name(default: Any = _MISSING) -> Any:
    """A field holding a dataset's name (validate_name's rule)."""
    return checked(validate_name, default)


def _type_name(hint: Any) -> str:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(hint))
    if origin is list:
        return f"a list of {_type_name(get_args(hint)[0])}"
    if origin is dict:
        return "an object"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(hint))
    if hint is type(None):
        return "null"
    if isinstance(hint, type) and issubclass(hint, Wire):
        return "an object"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        hint, str(hint)
    )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _decode(value: Any, hint: Any) -> Any:
    """`value` as of type `hint`, or _Bad."""
    if hint is Any:
        return value
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        options = get_args(hint)
        if value is None:
            if type(None) in options:
                return None
            raise _Bad(f"must be {_type_name(hint)}, not null")
        for option in options:
            if option is type(None):
                continue
            try:
                return _decode(value, option)
            except _Bad:
                continue
        raise _Bad(f"must be {_type_name(hint)}, not {_shown(value)}")
    if origin is Literal:
        if value in get_args(hint) and type(value) in {type(a) for a in get_args(hint)}:
            return value
        raise _Bad(f"must be {_type_name(hint)}, not {_shown(value)}")
    if origin is list:
        if not isinstance(value, list):
            raise _Bad(f"must be {_type_name(hint)}, not {_shown(value)}")
        (item,) = get_args(hint)
        return [_decode(v, item) for v in value]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _Bad(f"must be an object, not {_shown(value)}")
        _, item = get_args(hint)
        return {k: _decode(v, item) for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, Wire):
        if not isinstance(value, dict):
            raise _Bad(f"must be an object, not {_shown(value)}")
        try:
            return hint.from_wire(value)
        except InvalidArgument as e:
            raise _Bad(str(e)) from None
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    else:  # a type this module does not know: a contract's mistake, not the caller's
        raise TypeError(f"contract field of unsupported type {hint!r}")
    if not ok:
        raise _Bad(f"must be {_type_name(hint)}, not {_shown(value)}")
    return value


def _encode(value: Any) -> Any:
    if isinstance(value, Wire):
        return value.to_wire()
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


_FIELDS: dict[type, tuple[tuple[dataclasses.Field[Any], Any], ...]] = {}


def _fields(cls: type[Wire]) -> tuple[tuple[dataclasses.Field[Any], Any], ...]:
    """Each field with its resolved type hint, worked out once per type."""
    known = _FIELDS.get(cls)
    if known is None:
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        known = _FIELDS[cls] = tuple((f, hints[f.name]) for f in fields)
    return known


class Wire:
    """A frozen dataclass that crosses the wire as a JSON object of its fields."""

    @classmethod
    def _what(cls) -> str:
        return cls.__name__

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Self:
        """The checked value of `msg`; InvalidArgument, in one line naming the field, when a
        field is missing, unknown, of another type or out of range."""
        what = cls._what()
        known = {f.name for f, _ in _fields(cls)}
        unknown = sorted(k for k in msg if k not in known and k != "op")
        if unknown:
            raise InvalidArgument(f"{what}: unknown field {_shown(unknown[0])}")
        values: dict[str, Any] = {}
        for f, hint in _fields(cls):
            if f.name not in msg:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise InvalidArgument(f"{what}: field {f.name!r} is missing")
                continue
            try:
                value = _decode(msg[f.name], hint)
                check = f.metadata.get(_CHECK)
                values[f.name] = value if check is None else check(value)
            except (_Bad, ValueError, TypeError, OverflowError) as e:
                raise InvalidArgument(f"{what}: {f.name} {e}") from None
            except InvalidArgument as e:
                raise InvalidArgument(f"{what}: {f.name}: {e}") from None
        return cls(**values)

    def to_wire(self) -> dict[str, Any]:
        return {f.name: _encode(getattr(self, f.name)) for f, _ in _fields(type(self))}


class Request(Wire):
    """The request of one op; `OP` is the op's name on the wire."""

    OP: ClassVar[str]

    @classmethod
    def _what(cls) -> str:
        return f"op {cls.OP}"

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, **super().to_wire()}


def field_types(cls: type[Wire]) -> dict[str, Any]:
    """Each field's type hint, for tests that make requests of the wrong shape."""
    return {f.name: hint for f, hint in _fields(cls)}


def required(cls: type[Wire]) -> list[str]:
    """The fields a request must carry."""
    return [
        f.name
        for f, _ in _fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
