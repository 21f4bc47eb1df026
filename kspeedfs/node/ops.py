"""The node's operations, each registered by its owner together with the role it needs and
its request type (kspeedfs.format.contract), and the one dispatcher that checks a request
once off the wire and makes whatever a handler raises an answer."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from kspeedfs.format.auth import ROLES, allows
from kspeedfs.format.contract import Answer, Request, Wire
from kspeedfs.format.errors import AuthError, InternalError, InvalidArgument, KSpeedError

log = logging.getLogger(__name__)

# An answer's message is one line of at most this many characters.
MESSAGE_LIMIT = 500

# A handler takes its op's checked request; it answers a dict or a Wire type.
Handler = Callable[[Any], Awaitable[dict[str, Any] | Wire]]

ADMIN = "admin"
JOB = "job"
READ = "read"

# The role of the client whose request is being served (set per connection task); a call
# from inside the node runs as admin.
caller_role: contextvars.ContextVar[str] = contextvars.ContextVar("caller_role", default=ADMIN)


def one_line(text: str) -> str:
    """`text` as one line of at most MESSAGE_LIMIT characters (an error reply's message)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= MESSAGE_LIMIT else flat[: MESSAGE_LIMIT - 3] + "..."


def refusal(exc: BaseException) -> KSpeedError | None:
    """`exc` when it is a KSpeedError, the first one of an exception group whose every leaf
    is one (a nursery's failure that was a refusal keeps its class and exit code); None for
    anything unplanned."""
    if isinstance(exc, KSpeedError):
        return exc
    if not isinstance(exc, BaseExceptionGroup):
        return None
    leaves = [refusal(e) for e in exc.exceptions]
    return leaves[0] if leaves and all(leaves) else None


@contextlib.contextmanager
def answering(what: str) -> Iterator[None]:
    """Only a KSpeedError leaves the block: a request with a field missing or of the wrong
    type is refused as InvalidArgument; anything else unexpected is an InternalError in one
    line, logged here once with its traceback. `what` names the op in both."""
    try:
        yield
    except KSpeedError:
        raise
    except Exception as e:
        leaf = refusal(e)
        if leaf is not None:
            raise leaf from None
        if isinstance(e, (KeyError, TypeError, ValueError)):
            log.info("refused a malformed request to %s: %r", what, e)
            raise InvalidArgument(one_line(f"malformed request to {what}: {e!r}")) from None
        log.exception("internal error in %s", what)
        raise InternalError(
            one_line(f"internal error in {what}: {type(e).__name__}: {e}")
        ) from None


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    handler: Handler
    role: str  # the least role that may call it: admin > job > read
    request: type[Request]  # what the handler takes, checked off the wire


def _answer(result: dict[str, Any] | Wire) -> dict[str, Any]:
    return result.to_wire() if isinstance(result, Wire) else result


class OpRegistry:
    """What the server dispatches through: op name -> handler and role."""

    def __init__(self) -> None:
        self._ops: dict[str, Op] = {}

    def add(self, request: type[Request], handler: Handler, role: str) -> None:
        """Registers `handler` for the op of `request`'s type."""
        name = request.OP
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} for op {name!r}")
        if name in self._ops:
            raise ValueError(f"op {name!r} is registered twice")
        self._ops[name] = Op(name, handler, role, request)

    def get(self, name: str) -> Op:
        """The op, for a call from inside the node (no role to check)."""
        op = self._ops.get(name)
        if op is None:
            raise InvalidArgument(f"unknown operation {name!r}")
        return op

    def request_type(self, name: str) -> type[Request]:
        return self.get(name).request

    def authorize(self, name: object, role: str) -> Op:
        """The handler of an op a client with `role` asked for; refused when it may not."""
        op = self._ops.get(name) if isinstance(name, str) else None
        if op is None:
            raise InvalidArgument(f"unknown operation {name!r}")
        if not allows(role, op.role):
            raise AuthError(f"{op.name} needs the {op.role} role; this client has {role}")
        return op

    async def dispatch(self, msg: object, role: str) -> dict[str, Any]:
        """A client's request answered: its op's result, or a KSpeedError (nothing else).
        The request is checked against its op's type before the handler sees it."""
        if not isinstance(msg, dict):
            raise InvalidArgument("a request must be a JSON object")
        op = self.authorize(msg.get("op"), role)
        request = op.request.from_wire(msg)
        with answering(f"op {op.name}"):
            return _answer(await op.handler(request))

    async def call(self, request: Request[Answer]) -> Answer:
        """A call from inside the node, answered as a client's would be (no role to check):
        checked as if it came off the wire, so a value built in the node is held to the
        same contract, the answer too."""
        op = self.get(request.OP)
        checked = op.request.from_wire(request.to_wire())
        with answering(f"op {op.name}"):
            return request.answer(_answer(await op.handler(checked)))

    def names(self, role: str | None = None) -> list[str]:
        """Every op, or those registered with `role`."""
        return sorted(n for n, op in self._ops.items() if role is None or op.role == role)

    def allowed(self, role: str) -> list[str]:
        """The ops a client with `role` may call."""
        return sorted(n for n, op in self._ops.items() if allows(role, op.role))
