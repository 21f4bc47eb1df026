"""The ops NodeServer itself answers: liveness and what the node holds."""

from __future__ import annotations

import dataclasses

from kspeedfs.format.contract import Request, Wire


@dataclasses.dataclass(frozen=True)
class Ping(Request):
    OP = "ping"


@dataclasses.dataclass(frozen=True)
class Pong(Wire):
    node: str
    version: int
