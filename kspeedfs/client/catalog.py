"""The catalog's entry of a dataset: the JSON object under /kspeedfs/CLUSTER/datasets/NAME in etcd,
typed. It is parsed once where ClusterState reads etcd (`CatalogEntry.from_json`) and written
once where it writes (`to_json`); nodes of older versions read the same JSON, so `to_json` writes
the keys today's writers write, in their order, and keeps any key it does not know (a newer
node's) as it found it.

Every entry today's code writes has all fields but `lost` (added by the first heal or rebalance).
A field missing from an entry (a hand-written or older one) reads as the default the code read
it with before it was typed; a field of the wrong type, a state other than loading or ready, or a
value that is no JSON object makes the entry malformed (ValueError): ClusterState logs it on one
line and leaves it out of what it read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, cast, get_args

# A preload's entry is "loading" on its coordinator's lease, then "ready" (unleased).
CatalogState = Literal["loading", "ready"]
_STATES: tuple[str, ...] = get_args(CatalogState)


@dataclasses.dataclass(frozen=True)
class ListedInstance:
    """What the entry of a read-through dataset says once an instance of it is listed (published
    or refreshed): its instance, its placement and its size; `lost` starts empty again."""

    uuid: str
    members: tuple[str, ...]
    segments: int
    files: int
    bytes: int
    segment_size: int
    created: float


@dataclasses.dataclass(frozen=True)
class CatalogEntry:
    """One dataset in the catalog: which instance (`uuid`), its state, where it came from, how it
    is placed (`members`, `replicas`, `lost`) and its size."""

    name: str
    uuid: str
    state: CatalogState
    source: str = ""
    endpoint: str = ""  # object store endpoint of a URL source
    lifetime: str = ""  # "offline", "leased", or readthrough_view.READTHROUGH
    replicas: int = 1
    members: tuple[str, ...] = ()  # placed over these, in this order
    segment_size: int = 0
    segments: int = 0
    files: int = 0
    bytes: int = 0
    coordinator: str = ""  # the node that claimed it (a preload's coordinator)
    created: float | None = None  # seconds since the epoch; None: the key is absent
    # Members declared lost (their copies made again on the others); None: the key is absent
    # (no heal or rebalance has written it yet), which reads as none.
    lost: tuple[str, ...] | None = None
    # Keys this version does not know, kept as found so that a write does not drop them.
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def lost_members(self) -> tuple[str, ...]:
        return self.lost or ()

    def listed(self, instance: ListedInstance) -> CatalogEntry:
        """This entry naming a newly listed read-through instance, ready."""
        return dataclasses.replace(
            self,
            **{f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)},
            state="ready",
            lost=(),
        )

    @classmethod
    def from_json(cls, value: object) -> CatalogEntry:
        """The entry of a decoded JSON value; ValueError naming what is wrong when malformed."""
        if not isinstance(value, dict):
            raise ValueError(f"not a JSON object but {type(value).__name__}")
        for key in ("name", "uuid", "state"):
            if key not in value:
                raise ValueError(f"no {key!r}")
        fields: dict[str, Any] = {k: _checked(k, value[k]) for k in _KNOWN if k in value}
        if fields["state"] not in _STATES:
            raise ValueError(f"state {fields['state']!r} is neither loading nor ready")
        extra = {k: v for k, v in value.items() if k not in _KNOWN}
        return cls(**fields, extra=extra)

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to etcd (json.dumps of it): every field in declaration
        order but those None (absent), then the keys kept from a newer writer."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or value is None:
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        for k, v in self.extra.items():
            out.setdefault(k, v)
        return out


# The fields read from the JSON (every one but `extra`), in declaration order.
_KNOWN = tuple(f.name for f in dataclasses.fields(CatalogEntry) if f.name != "extra")

# The JSON type each field is read as: str, int (not bool), a number, or a list of strings.
_STR = ("name", "uuid", "state", "source", "endpoint", "lifetime", "coordinator")
_INT = ("replicas", "segment_size", "segments", "files", "bytes")
_NAMES = ("members", "lost")


def _checked(key: str, value: object) -> object:
    if key in _STR:
        if not isinstance(value, str):
            raise ValueError(f"{key!r} is not a string")
        return value
    if key in _INT:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key!r} is not an integer")
        return value
    if key in _NAMES:
        if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
            raise ValueError(f"{key!r} is not a list of strings")
        return tuple(cast(list[str], value))
    assert key == "created", key
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key!r} is not a number")
    return value
