"""The client's side of the HELLO/AUTH handshake, sans-IO: both clients move the bytes, this decides.

The node opens with HELLO (its address and a fresh nonce); the client answers AUTH (the role of
its token and an HMAC of the nonce keyed by the token); the node answers RESPONSE with the role
it granted, or ERROR (AuthError) and closes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kspeedfs.format import auth, protocol
from kspeedfs.format.errors import ProtocolError
from kspeedfs.format.protocol import MsgType

HANDSHAKE_ID = 0  # the request id of the handshake frames


@dataclasses.dataclass
class ClientHandshake:
    """One handshake: `answer` the node's HELLO, then `check` its RESPONSE."""

    token: str
    peer: str  # the address dialled, for messages
    node: str = ""  # the node's own name for itself, from HELLO
    role: str = ""  # granted, once checked

    def answer(self, hello: dict[str, Any]) -> bytes:
        """The AUTH frame that answers a HELLO message."""
        nonce_hex = hello.get("nonce")
        try:
            nonce = bytes.fromhex(nonce_hex) if isinstance(nonce_hex, str) else b""
        except ValueError:
            nonce = b""
        if not nonce:
            raise ProtocolError(f"node {self.peer} sent a HELLO without a valid nonce")
        self.node = str(hello.get("node", ""))
        msg = {"role": auth.token_role(self.token), "mac": auth.respond(self.token, nonce)}
        return protocol.encode_json(MsgType.AUTH, HANDSHAKE_ID, msg)

    def check(self, response: dict[str, Any]) -> str:
        """The role the node granted, from its RESPONSE; it must be the one asked for."""
        asked = auth.token_role(self.token)
        granted = response.get("role")
        if granted != asked:
            raise ProtocolError(f"node {self.peer} granted role {granted!r}, not {asked!r}")
        self.role = asked
        return asked
