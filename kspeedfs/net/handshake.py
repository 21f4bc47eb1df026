"""The client's side of the HELLO/AUTH handshake, sans-IO: both clients move the bytes, this decides.

The node opens with HELLO (its address and a fresh nonce); the client answers AUTH (the role of
its token, a nonce of its own, and an HMAC over both nonces and the channel keyed by the token);
the node answers RESPONSE with the role it granted and its own HMAC over the same, which proves
that it holds the token too, or ERROR (AuthError) and closes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kspeedfs.format import auth, protocol, users
from kspeedfs.format.errors import AuthError, ProtocolError
from kspeedfs.format.protocol import MsgType

HANDSHAKE_ID = 0  # the request id of the handshake frames


@dataclasses.dataclass
class ClientHandshake:
    """One handshake: `answer` the node's HELLO, then `check` its RESPONSE."""

    token: str | auth.UserLogin  # a token, or a user and password
    peer: str  # the address dialled, for messages
    channel: str = auth.TCP  # the connection's label (secure.channel)
    node: str = ""  # the node's own name for itself, from HELLO
    role: str = ""  # granted, once checked
    _node_nonce: bytes = b""
    _nonce: bytes = b""
    _key: str = ""  # a user's key, derived from the HELLO's realm

    def answer(self, hello: dict[str, Any]) -> bytes:
        """The AUTH frame that answers a HELLO message."""
        try:
            self._node_nonce = auth.parse_nonce(hello.get("nonce"))
        except AuthError:
            raise ProtocolError(f"node {self.peer} sent a HELLO without a valid nonce") from None
        self.node = str(hello.get("node", ""))
        if isinstance(self.token, auth.UserLogin):
            self._key = users.login_key(self.token, hello.get("realm"))
            msg, self._nonce = auth.user_answer(
                self._key, self.token.user, self.channel, self._node_nonce
            )
        else:
            msg, self._nonce = auth.client_answer(self.token, self.channel, self._node_nonce)
        return protocol.encode_json(MsgType.AUTH, HANDSHAKE_ID, msg)

    def check(self, response: dict[str, Any]) -> str:
        """The role the node granted, from its RESPONSE: it must be the one asked for, and the
        node must prove that it holds the token (else a node that is none could serve us)."""
        if isinstance(self.token, auth.UserLogin):
            return self._check_user(self.token, response)
        asked = auth.token_role(self.token)
        granted = response.get("role")
        if granted != asked:
            raise ProtocolError(f"node {self.peer} granted role {granted!r}, not {asked!r}")
        mac = response.get("mac")
        if not auth.verify_node(self.token, self.channel, self._node_nonce, self._nonce, mac):
            raise AuthError(f"node {self.peer} did not prove that it holds the cluster token")
        self.role = asked
        return asked

    def _check_user(self, login: auth.UserLogin, response: dict[str, Any]) -> str:
        granted = response.get("role")
        if not isinstance(granted, str) or granted not in auth.ROLES:
            raise ProtocolError(f"node {self.peer} granted no known role: {granted!r}")
        mac = response.get("mac")
        nonces = (self._node_nonce, self._nonce)
        if not auth.verify_node_user(self._key, login.user, self.channel, *nonces, mac):
            raise AuthError(f"node {self.peer} did not prove that it knows user {login.user}")
        self.role = granted
        return granted
