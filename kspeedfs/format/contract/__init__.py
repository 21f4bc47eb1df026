"""Typed op contracts: every node op's request (and, where callers read it, its answer) as a
frozen dataclass, checked once when it comes off the wire.

A request type names its op in `OP` and declares its fields with their types; `from_wire`
turns a JSON object into a checked instance (types, ranges, names) or raises InvalidArgument
in one line that names the op and the field, so a handler only ever sees checked values.
`to_wire` is what a caller sends. A request names its answer's type (`class Ping(Request["Pong"])`,
as 3FS binds BatchReadReq to BatchReadRsp): `answer` checks an answer off the wire into it, the
one place an answer is decoded, so a call returns the request's own answer type. The modules of this package hold the types of one owner
each (`contract.preload` for the preload's ops, ...): an op's request type and its owner are
found by its module's name.

Field types understood: bool, int, float, str, Any, `X | None`, `list[X]`, `dict[str, X]`,
`Literal[...]` and nested Wire types (sent as JSON objects). Further checks come from the
field's metadata: `at_least(n)`, `dataset_name()`, `checked(fn)`.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Mapping
from typing import (
    Any,
    ClassVar,
    ForwardRef,
    Generic,
    Literal,
    Self,
    TypeVar,
    Union,
    cast,
    get_args,
    get_origin,
)

from kspeedfs.format.errors import InvalidArgument
from kspeedfs.format.names import validate_name

READTHROUGH = "readthrough"  # the lifetime of a read-through dataset (on the wire and in meta.json)

_CHECK = "kspeedfs.check"  # the metadata key of a field's extra check
_MISSING: Any = dataclasses.MISSING


class _Bad(Exception):
    """A field's value refused; becomes one InvalidArgument naming the op and the field."""


def checked(
    check: Callable[[Any], Any], default: Any = _MISSING, factory: Callable[[], Any] = _MISSING
) -> Any:
    """A field whose value, once of the right type, also passes `check` (which returns the
    value to keep, or raises InvalidArgument or ValueError with the reason). `factory` makes
    the default of a list or dict field."""
    if factory is not _MISSING:
        return dataclasses.field(default_factory=factory, metadata={_CHECK: check})
    return dataclasses.field(default=default, metadata={_CHECK: check})


def at_least(
    minimum: int | float, default: Any = _MISSING, factory: Callable[[], Any] = _MISSING
) -> Any:
    """A number field (or list of numbers) of at least `minimum`; None passes, for an
    optional field."""

    def check(value: Any) -> Any:
        values = value if isinstance(value, list) else [] if value is None else [value]
        for v in values:
            if v < minimum:
                raise _Bad(f"must be at least {minimum}, not {v}")
        return value

    return checked(check, default, factory)


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


Decoder = Callable[[Any], Any]


def _refuse(hint: Any, value: Any) -> _Bad:
    return _Bad(f"must be {_type_name(hint)}, not {_shown(value)}")


def _scalar(hint: Any) -> Decoder:
    if hint is bool:

        def boolean(value: Any) -> Any:
            if value is True or value is False:
                return value
            raise _refuse(hint, value)

        return boolean
    if hint is int:

        def integer(value: Any) -> Any:
            if type(value) is int:  # bool is an int subclass: refused
                return value
            raise _refuse(hint, value)

        return integer
    if hint is float:

        def number(value: Any) -> Any:
            if type(value) in (int, float):
                return float(value)
            raise _refuse(hint, value)

        return number
    if hint is str:

        def string(value: Any) -> Any:
            if type(value) is str:
                return value
            raise _refuse(hint, value)

        return string
    raise TypeError(f"contract field of unsupported type {hint!r}")  # the contract's mistake


def _union(hint: Any) -> Decoder:
    options = [_decoder(a) for a in get_args(hint) if a is not type(None)]
    nullable = type(None) in get_args(hint)

    def union(value: Any) -> Any:
        if value is None:
            if nullable:
                return None
            raise _Bad(f"must be {_type_name(hint)}, not null")
        for option in options:
            try:
                return option(value)
            except _Bad:
                continue
        raise _refuse(hint, value)

    return union


def _literal(hint: Any) -> Decoder:
    allowed = {(type(a), a) for a in get_args(hint)}

    def literal(value: Any) -> Any:
        if (type(value), value) in allowed:
            return value
        raise _refuse(hint, value)

    return literal


def _list(hint: Any) -> Decoder:
    item = _decoder(get_args(hint)[0])

    def items(value: Any) -> Any:
        if type(value) is not list:
            raise _refuse(hint, value)
        return [item(v) for v in value]

    return items


def _dict(hint: Any) -> Decoder:
    item = _decoder(get_args(hint)[1])

    def mapping(value: Any) -> Any:
        if type(value) is not dict or not all(type(k) is str for k in value):
            raise _Bad(f"must be an object, not {_shown(value)}")
        return {k: item(v) for k, v in value.items()}

    return mapping


def _nested(hint: type[Wire]) -> Decoder:
    def nested(value: Any) -> Any:
        if type(value) is not dict:
            raise _Bad(f"must be an object, not {_shown(value)}")
        try:
            return hint.from_wire(value)
        except InvalidArgument as e:
            raise _Bad(str(e)) from None

    return nested


def _decoder(hint: Any) -> Decoder:
    """The function that checks a value against type `hint`, made once per field."""
    if hint is Any:
        return lambda value: value
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return _union(hint)
    if origin is Literal:
        return _literal(hint)
    if origin is list:
        return _list(hint)
    if origin is dict:
        return _dict(hint)
    if isinstance(hint, type) and issubclass(hint, Wire):
        return _nested(hint)
    return _scalar(hint)


def _encode(value: Any) -> Any:
    if isinstance(value, Wire):
        return value.to_wire()
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    hint: Any
    decode: Decoder
    check: Callable[[Any], Any] | None
    required: bool


_FIELDS: dict[type, tuple[_Field, ...]] = {}


def _fields(cls: type[Wire]) -> tuple[_Field, ...]:
    """Each field with its decoder, worked out once per type (a request is decoded on every
    op, so the type hints are not walked each time)."""
    known = _FIELDS.get(cls)
    if known is None:
        hints = typing.get_type_hints(cls)
        known = _FIELDS[cls] = tuple(
            _Field(
                f.name,
                hints[f.name],
                _decoder(hints[f.name]),
                f.metadata.get(_CHECK),
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        )
    return known


class Wire:
    """A frozen dataclass that crosses the wire as a JSON object of its fields."""

    # An answer with a field this version does not know (a newer node's) is read without it,
    # as the clients' dict reads did: a mixed-version cluster during an upgrade keeps working.
    # A request's unknown field is refused (Request): the op would not do what was asked.
    UNKNOWN_FIELDS_REFUSED: ClassVar[bool] = False

    @classmethod
    def _what(cls) -> str:
        return cls.__name__

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Self:
        """The checked value of `msg`; InvalidArgument, in one line naming the field, when a
        field is missing, of another type or out of range, or unknown (a request's)."""
        fields = _fields(cls)
        values: dict[str, Any] = {}
        for f in fields:
            if f.name not in msg:
                if f.required:
                    raise InvalidArgument(f"{cls._what()}: field {f.name!r} is missing")
                continue
            try:
                value = f.decode(msg[f.name])
                values[f.name] = value if f.check is None else f.check(value)
            except (_Bad, ValueError, TypeError, OverflowError) as e:
                raise InvalidArgument(f"{cls._what()}: {f.name} {e}") from None
            except InvalidArgument as e:
                raise InvalidArgument(f"{cls._what()}: {f.name}: {e}") from None
        if cls.UNKNOWN_FIELDS_REFUSED and len(values) + ("op" in msg) != len(msg):
            known = {f.name for f in fields}
            unknown = sorted(k for k in msg if k not in known and k != "op")
            if unknown:
                raise InvalidArgument(f"{cls._what()}: unknown field {_shown(unknown[0])}")
        return cls(**values)

    def to_wire(self) -> dict[str, Any]:
        return {f.name: _encode(getattr(self, f.name)) for f in _fields(type(self))}


AnswerT = TypeVar("AnswerT", bound=Wire, covariant=True)
Answer = TypeVar("Answer", bound=Wire)  # a call's answer: the type its request names


class Request(Wire, Generic[AnswerT]):
    """The request of one op; `OP` is the op's name on the wire, `AnswerT` its answer's type
    (a union of several: the request's own `answer` tells them apart)."""

    OP: ClassVar[str]
    UNKNOWN_FIELDS_REFUSED = True
    _answer_hint: ClassVar[Any] = None  # AnswerT as the class statement gave it

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in cls.__dict__.get("__orig_bases__", ()):
            origin = get_origin(base)
            if isinstance(origin, type) and issubclass(origin, Request):
                (hint,) = get_args(base)
                if not isinstance(hint, TypeVar):
                    cls._answer_hint = hint

    def answer(self, msg: Mapping[str, Any]) -> AnswerT:
        """This request's answer off the wire, checked (InvalidArgument in one line when it
        is not of the request's answer type)."""
        return cast(AnswerT, answer_type(type(self)).from_wire(msg))

    @classmethod
    def _what(cls) -> str:
        return f"op {cls.OP}"

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, **super().to_wire()}


_ANSWER_TYPES: dict[type, type[Wire]] = {}


def answer_type(cls: type[Request[Any]]) -> type[Wire]:
    """The Wire type a request class names for its answer (its module's name for it resolved
    once)."""
    known = _ANSWER_TYPES.get(cls)
    if known is None:
        hint = answer_hint(cls)
        if not (isinstance(hint, type) and issubclass(hint, Wire)):
            raise TypeError(f"{cls.__name__} answers {hint!r}: its own `answer` must decode it")
        known = _ANSWER_TYPES[cls] = hint
    return known


def answer_hint(cls: type[Request[Any]]) -> Any:
    """A request class's answer type as its annotations would give it (a union resolved)."""
    hint = cls._answer_hint
    if isinstance(hint, ForwardRef):
        hint = eval(hint.__forward_arg__, vars(sys.modules[cls.__module__]))  # noqa: S307
    return hint


def field_types(cls: type[Wire]) -> dict[str, Any]:
    """Each field's type hint, for tests that make requests of the wrong shape."""
    return {f.name: f.hint for f in _fields(cls)}


def required(cls: type[Wire]) -> list[str]:
    """The fields a request must carry."""
    return [f.name for f in _fields(cls) if f.required]
