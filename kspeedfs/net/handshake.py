"""The client's side of the HELLO/AUTH handshake, sans-IO: both clients move the bytes, this decides.

The node opens with HELLO (its address and a fresh nonce); the client answers AUTH (the role of
its token, a nonce of its own, and an HMAC over both nonces and the channel keyed by the token);
the node answers RESPONSE with the role it granted and its own HMAC over the same, which proves
that it holds the token too, or ERROR (AuthError) and closes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kspeedfs.format import auth, protocol
from kspeedfs.format.errors import AuthError, ProtocolError
from kspeedfs.format.protocol import MsgType

HANDSHAKE_ID = 0  # the request id of the handshake frames


@dataclasses.dataclass
class ClientHandshake:
    """One handshake: `answer` the node's HELLO, then `check` its RESPONSE."""

    token: str
    peer: str  # the address dialled, for messages
    channel: str = auth.TCP  # the connection's label (secure.channel)
    node: str = ""  # the node's own name for itself, from HELLO
    role: str = ""  # granted, once checked
    _node_nonce: bytes = b""
    _nonce: bytes = b""

    def answer(self, hello: dict[str, Any]) -> bytes:
        """The AUTH frame that answers a HELLO message."""
        try:
            self._node_nonce = auth.parse_nonce(hello.get("nonce"))
        except AuthError:
            raise ProtocolError(f"node {self.peer} sent a HELLO without a valid nonce") from None
        self.node = str(hello.get("node", ""))
        msg, self._nonce = auth.client_answer(self.token, self.channel, self._node_nonce)
        return protocol.encode_json(MsgType.AUTH, HANDSHAKE_ID, msg)

    def check(self, response: dict[str, Any]) -> str:
        """The role the node granted, from its RESPONSE: it must be the one asked for, and the
        node must prove that it holds the token (else a node that is none could serve us)."""
        asked = auth.token_role(self.token)
        granted = response.get("role")
        if granted != asked:
            raise ProtocolError(f"node {self.peer} granted role {granted!r}, not {asked!r}")
        mac = response.get("mac")
        if not auth.verify_node(self.token, self.channel, self._node_nonce, self._nonce, mac):
            raise AuthError(f"node {self.peer} did not prove that it holds the cluster token")
        self.role = asked
        return asked
