"""The node's operations, each registered by its owner together with the role it needs."""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from kspeedfs.format.auth import ROLES, allows
from kspeedfs.format.errors import AuthError, InvalidArgument

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]

ADMIN = "admin"
JOB = "job"
READ = "read"

# The role of the client whose request is being served (set per connection task); a call
# from inside the node runs as admin.
caller_role: contextvars.ContextVar[str] = contextvars.ContextVar("caller_role", default=ADMIN)


def int_field(msg: dict[str, Any], key: str, default: int, minimum: int = 0) -> int:
    """An integer field of a request, refused in one line when of another type or too small."""
    value = msg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{key} must be an integer, not {type(value).__name__}")
    if value < minimum:
        raise InvalidArgument(f"{key} must be at least {minimum}, not {value}")
    return value


def str_field(msg: dict[str, Any], key: str, default: str = "") -> str:
    """A string field of a request, refused in one line when of another type."""
    value = msg.get(key, default)
    if not isinstance(value, str):
        raise InvalidArgument(f"{key} must be a string, not {type(value).__name__}")
    return value


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    handler: Handler
    role: str  # the least role that may call it: admin > job > read


class OpRegistry:
    """What the server dispatches through: op name -> handler and role."""

    def __init__(self) -> None:
        self._ops: dict[str, Op] = {}

    def add(self, name: str, handler: Handler, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} for op {name!r}")
        if name in self._ops:
            raise ValueError(f"op {name!r} is registered twice")
        self._ops[name] = Op(name, handler, role)

    def handler(self, name: str) -> Handler:
        """The op's handler, for a call from inside the node (no role to check)."""
        op = self._ops.get(name)
        if op is None:
            raise InvalidArgument(f"unknown operation {name!r}")
        return op.handler

    def authorize(self, name: object, role: str) -> Handler:
        """The handler of an op a client with `role` asked for; refused when it may not."""
        op = self._ops.get(name) if isinstance(name, str) else None
        if op is None:
            raise InvalidArgument(f"unknown operation {name!r}")
        if not allows(role, op.role):
            raise AuthError(f"{op.name} needs the {op.role} role; this client has {role}")
        return op.handler

    def names(self, role: str | None = None) -> list[str]:
        """Every op, or those registered with `role`."""
        return sorted(n for n, op in self._ops.items() if role is None or op.role == role)

    def allowed(self, role: str) -> list[str]:
        """The ops a client with `role` may call."""
        return sorted(n for n, op in self._ops.items() if allows(role, op.role))
