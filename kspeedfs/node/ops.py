"""The node's operations, each registered by its owner together with the role it needs."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from kspeedfs.format.auth import ROLES
from kspeedfs.format.errors import AuthError, InvalidArgument

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]

ADMIN = "admin"
READ = "read"


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    handler: Handler
    role: str  # the least role that may call it: "read" ops are open to admins too


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
        if op.role == ADMIN and role != ADMIN:
            raise AuthError(f"{op.name} needs the admin role; this client has {role}")
        return op.handler

    def names(self, role: str | None = None) -> list[str]:
        """Every op, or those registered with `role`."""
        return sorted(n for n, op in self._ops.items() if role is None or op.role == role)
