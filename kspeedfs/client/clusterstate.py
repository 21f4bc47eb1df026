"""The cluster's shared state in etcd: members (keys on leases) and the dataset catalog.

Keys under /kspeedfs/CLUSTER/:
    members/ADDR   a live node; on the node's lease, so it goes when the node stops renewing.
                   Its mod revision is that registration's fencing token.
    known/ADDR     every node that ever joined (so a node that is gone shows as down)
    down/ADDR      a survivor saw ADDR gone: written only in a transaction that finds
                   members/ADDR absent (so never for a live member), removed in the transaction
                   that registers ADDR again
    grace/ADDR     written with down/ADDR, on a lease of `heal_after` seconds: when etcd expires
                   it (etcd's clock, not a node's), ADDR is lost. A note older than the
                   observer's own registration is stale (etcd itself was away: every lease
                   lapsed) and is written again, with a new grace, before it can count.
    datasets/NAME  the dataset's record: instance id, state, members, replicas, source, ...
                   (a CatalogEntry; one that does not parse is logged and left out)
A preload's record is created on its coordinator's lease (state "loading"), so it vanishes with
a coordinator that dies; it is made "ready" and unleased in one transaction compared on the
record that names the instance. Unload deletes the record the same way.

An https:// endpoint is checked against `tls_ca` (else the system's CAs) and shown `tls_cert` and
`tls_key`, the files of kspeedfs's own TLS; a TLS failure is one line naming etcd (AuthError).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import etcd3gw
import requests
from etcd3gw import exceptions as etcd_errors
from etcd3gw.lease import Lease

from kspeedfs.client.catalog import CatalogEntry
from kspeedfs.format.config import Settings
from kspeedfs.format.contract.pieces import from_base64, to_base64
from kspeedfs.format.errors import AlreadyExists, AuthError, Fenced, NodeUnreachable, NotFound
from kspeedfs.format.tls import client_context, reason
from kspeedfs.format.units import Address, parse_address

log = logging.getLogger(__name__)

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)
# A member's key (members/, down/) as JSON: read by key (since, address, pid, by).
Json = dict[str, Any]
# What a ClusterState call raises when etcd cannot be used: it does not answer, or the TLS
# between us fails (a setup problem: no retry helps, but the data path goes on).
UNAVAILABLE = (NodeUnreachable, AuthError)


def _b64(text: str) -> str:
    return to_base64(text.encode())


def _range_end(prefix: str) -> str:
    return _b64(prefix[:-1] + chr(ord(prefix[-1]) + 1))


@dataclasses.dataclass(frozen=True)
class Registration:
    """One registration of a node: its lease, and the revision that wrote its members/ key
    (only a registration writes it), the fencing token its catalog writes are compared on."""

    address: str
    lease: int
    revision: int


@dataclasses.dataclass(frozen=True)
class Key:
    value: Json
    create: int  # create revision
    mod: int  # mod revision


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The cluster's keys read at one etcd revision."""

    revision: int
    members: dict[str, Key]
    known: set[str]
    down: dict[str, Key]
    grace: set[str]  # members whose grace lease etcd has not expired yet
    datasets: dict[str, tuple[CatalogEntry, int]]

    def registered(self, me: Registration | None) -> bool:
        """`me` is still the registration etcd holds (not lapsed, not replaced)."""
        return me is not None and getattr(self.members.get(me.address), "mod", 0) == me.revision

    def stale_note(self, address: str, me: Registration) -> bool:
        """A down note written before `me` registered: etcd was away meanwhile (every lease
        lapsed with it), so its grace tells nothing; it is written again."""
        note = self.down.get(address)
        return note is not None and note.mod < me.revision

    def lost(self, address: str, me: Registration) -> bool:
        """`address` is gone for heal_after by etcd's clock: absent, noted since `me`
        registered, and its grace lease expired."""
        note = self.down.get(address)
        return (
            address not in self.members
            and note is not None
            and note.mod > me.revision
            and address not in self.grace
        )


# Compares a transaction can be guarded with.
def member_is(prefix: str, me: Registration) -> dict[str, Any]:
    """`me` is still registered: the fence of a node's catalog writes."""
    key = _b64(prefix + "members/" + me.address)
    return {"key": key, "result": "EQUAL", "target": "MOD", "mod_revision": me.revision}


def absent(key: str) -> dict[str, Any]:
    return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}


def mod_is(key: str, revision: int) -> dict[str, Any]:
    return {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": revision}


class ClusterState:
    """Blocking access to one cluster's keys; each call tries the endpoints in turn and fails
    with one line naming etcd when none answers (NodeUnreachable; AuthError when one refused
    the TLS between us, or we refused its certificate)."""

    def __init__(
        self,
        endpoints: list[str],
        cluster: str,
        timeout: float = 5.0,
        tls: tuple[Path, Path, Path] | None = None,
    ):
        """`tls`: (cert, key, CA) for https:// endpoints; None: no client certificate, and
        etcd's certificate is checked against the system's CAs."""
        if not endpoints:
            raise NotFound("no etcd endpoints configured")
        self.endpoints = endpoints
        self.prefix = f"/kspeedfs/{cluster}/"
        self.timeout = timeout
        self._with_cert = tls is not None
        self._clients = []
        for url in endpoints:
            parts = urlsplit(url)
            self._clients.append(
                etcd3gw.Etcd3Client(
                    host=parts.hostname or "127.0.0.1",
                    port=parts.port or 2379,
                    protocol=parts.scheme or "http",
                    timeout=timeout,
                    api_path="/v3/",  # etcd 3.4 and newer
                    session=_tls_session(tls) if parts.scheme == "https" else None,
                )
            )
        self._first = 0

    @classmethod
    def of(cls, settings: Settings, timeout: float = 5.0) -> ClusterState:
        tls = None
        if settings.tls() and any(url.startswith("https://") for url in settings.etcd):
            client_context(settings)  # unreadable or mismatched files: one line, before any call
            assert settings.tls_cert and settings.tls_key and settings.tls_ca
            tls = (settings.tls_cert, settings.tls_key, settings.tls_ca)
        return cls(settings.etcd, settings.cluster, min(settings.timeout, timeout), tls)

    def _call(self, fn: Callable[[etcd3gw.Etcd3Client], T]) -> T:
        last: Exception | None = None
        refused: AuthError | None = None
        for k in range(len(self._clients)):
            i = (self._first + k) % len(self._clients)
            try:
                out = fn(self._clients[i])
                self._first = i
                return out
            except (
                etcd_errors.ConnectionFailedError,
                etcd_errors.ConnectionTimeoutError,
                etcd_errors.InternalServerError,  # a member starting again, or without quorum
            ) as e:
                last = e
                refused = self._tls_refusal(self.endpoints[i], e) or refused
        if refused is not None:  # rather than "does not answer": the TLS setup is what to fix
            raise refused
        why = (str(last).splitlines() or [type(last).__name__])[0]
        raise NodeUnreachable(f"etcd at {', '.join(self.endpoints)} does not answer: {why}")

    def _tls_refusal(self, url: str, e: BaseException) -> AuthError | None:
        """The one line for a call that failed on TLS: a handshake error toward an https://
        endpoint, or an http:// endpoint that hung up on a plain request and speaks TLS."""
        parts = urlsplit(url)
        if parts.scheme == "https":
            cause = _under(e, ssl.SSLError)
            if cause is None:
                return None
            if not isinstance(cause, ssl.SSLEOFError):
                why = reason(cause)
            elif self._with_cert:  # etcd hangs up on a certificate from another CA
                why = "etcd closed the connection in the handshake (does it trust tls_cert's CA?)"
            else:
                why = "etcd closed the connection in the handshake (set tls_cert, tls_key, tls_ca)"
            return AuthError(f"TLS with etcd at {url} failed: {why}")
        host, port = parts.hostname or "127.0.0.1", parts.port or 2379
        # What etcd does to plain HTTP on a TLS port: it hangs up without a reply, closing
        # (RemoteDisconnected) or, with the request still unread, resetting the connection.
        hung_up = _under(e, ConnectionResetError) or _under(e, BrokenPipeError)
        if hung_up and _speaks_tls(host, port, self.timeout):
            return AuthError(
                f"etcd at {url} accepts TLS connections only: use https:// endpoints "
                "(with tls_cert, tls_key and tls_ca)"
            )
        return None

    def _prefix(self, sub: str) -> dict[str, tuple[Json, int]]:
        """key tail -> (value, mod_revision) of every key under PREFIX/sub/."""
        start = self.prefix + sub + "/"
        rows = self._call(lambda c: c.get_prefix(start))
        out = {}
        for value, meta in rows:
            key = meta["key"].decode() if isinstance(meta["key"], bytes) else str(meta["key"])
            try:
                out[key[len(start) :]] = (json.loads(value), int(meta["mod_revision"]))
            except ValueError:
                log.warning("ignoring a malformed etcd value at %s", key)
        return out

    def _txn(self, txn: dict[str, Any]) -> bool:
        return bool(self._txn_answer(txn).get("succeeded", False))

    def _holds(self, compare: list[dict[str, Any]]) -> bool:
        """Whether every compare holds now (an empty transaction)."""
        return self._txn({"compare": compare, "success": [], "failure": []})

    def _txn_answer(self, txn: dict[str, Any]) -> dict[str, Any]:
        return dict(self._call(lambda c: c.transaction(txn)))

    # Membership.

    def register(self, address: str, ttl: float, pid: int) -> Registration:
        """Join: a new lease, members/ADDR on it, known/ADDR, and ADDR's down note and grace
        gone, in one transaction."""
        lease = self._call(lambda c: c.lease(max(2, round(ttl))))
        value = json.dumps({"address": address, "since": time.time(), "pid": pid})
        key = self.prefix + "members/" + address
        answer = self._txn_answer(
            {
                "compare": [],
                "success": [
                    {"request_put": {"key": _b64(key), "value": _b64(value), "lease": lease.id}},
                    {
                        "request_put": {
                            "key": _b64(self.prefix + "known/" + address),
                            "value": _b64(json.dumps({"address": address})),
                        }
                    },
                    {"request_delete_range": {"key": _b64(self.prefix + "down/" + address)}},
                    {"request_delete_range": {"key": _b64(self.prefix + "grace/" + address)}},
                ],
                "failure": [],
            }
        )
        return Registration(address, int(lease.id), int(answer["header"]["revision"]))

    def keep_alive(self, lease_id: int) -> bool:
        """Renew a lease; False when it has expired (the node must register again)."""
        return self._call(lambda c: Lease(lease_id, c).refresh()) > 0

    def revoke(self, lease_id: int) -> None:
        self._call(lambda c: Lease(lease_id, c).revoke())

    def live_members(self) -> dict[str, Json]:
        return {k: v for k, (v, _rev) in self._prefix("members").items()}

    def note_down(self, address: str, me: Registration, heal_after: float, stale: int = 0) -> bool:
        """Note `address` gone, with a grace of `heal_after` seconds kept by etcd: only while
        members/ADDR is absent and `me` still registered, over no note (`stale` 0) or over the
        stale note of mod revision `stale`. False: the transaction found otherwise."""
        down = self.prefix + "down/" + address
        grace = self.prefix + "grace/" + address
        value = json.dumps({"since": time.time(), "by": me.address})
        ops: list[dict[str, Any]] = [
            {"request_put": {"key": _b64(down), "value": _b64(value)}},
            {"request_delete_range": {"key": _b64(grace)}},
        ]
        lease = None
        if heal_after > 0:
            # etcd refuses TTLs under its minimum (about 2 s by default) by raising them.
            lease = self._call(lambda c: c.lease(max(1, math.ceil(heal_after))))
            ops[1] = {"request_put": {"key": _b64(grace), "value": "", "lease": lease.id}}
        compare = [
            absent(self.prefix + "members/" + address),
            member_is(self.prefix, me),
            mod_is(down, stale) if stale else absent(down),
        ]
        done = self._txn({"compare": compare, "success": ops, "failure": []})
        if not done and lease is not None:
            self._call(lambda c: Lease(lease.id, c).revoke())
        return done

    def snapshot(self) -> Snapshot:
        """Every key of the cluster, read at one revision."""
        start = self.prefix
        answer = self._call(
            lambda c: c.post(
                c.get_url("/kv/range"),
                json={"key": _b64(start), "range_end": _range_end(start)},
            )
        )
        keys: dict[str, dict[str, Key]] = {}
        for kv in answer.get("kvs", []):
            name = from_base64(kv["key"], "an etcd key").decode()[len(start) :]
            kind, _, tail = name.partition("/")
            raw = from_base64(kv.get("value", ""), "an etcd value")
            try:
                value = json.loads(raw) if raw else {}
            except ValueError:
                log.warning("ignoring a malformed etcd value at %s%s", start, name)
                continue
            found = Key(value, int(kv.get("create_revision", 0)), int(kv.get("mod_revision", 0)))
            keys.setdefault(kind, {})[tail] = found
        return Snapshot(
            revision=int(answer["header"]["revision"]),
            members=keys.get("members", {}),
            known=set(keys.get("known", {})),
            down=keys.get("down", {}),
            grace=set(keys.get("grace", {})),
            datasets=_entries(
                start + "datasets/",
                {n: (k.value, k.mod) for n, k in keys.get("datasets", {}).items()},
            ),
        )

    def member_table(self) -> list[Json]:
        """Every node that ever joined: {node, state, since}, sorted by address. State: up;
        down (gone from etcd, its grace running: `grace` true); lost (a catalog record
        declared it lost: its copies were made again elsewhere)."""
        snap = self.snapshot()
        lost = {m for entry, _rev in snap.datasets.values() for m in entry.lost_members}
        rows: list[Json] = []
        for address in sorted(snap.known | set(snap.members)):
            member = snap.members.get(address)
            if member is not None:
                rows.append({"node": address, "state": "up", "since": member.value.get("since")})
                continue
            note = snap.down.get(address)
            rows.append(
                {
                    "node": address,
                    "state": "lost" if address in lost else "down",
                    "since": note.value.get("since") if note else None,
                    "grace": address in snap.grace,
                }
            )
        return rows

    def forget(self, address: str) -> None:
        """Remove a node for good (it shows no more as down)."""
        for sub in ("known/", "down/", "grace/"):
            key = self.prefix + sub + address
            self._call(functools.partial(_delete, key=key))

    # The catalog.

    def datasets(self) -> dict[str, tuple[CatalogEntry, int]]:
        """name -> (entry, mod_revision)."""
        return _entries(self.prefix + "datasets/", self._prefix("datasets"))

    def dataset(self, name: str) -> tuple[CatalogEntry, int] | None:
        """name's (entry, mod_revision); only its entry is parsed (a malformed one: None)."""
        found = self._prefix("datasets").get(name)
        if found is None:
            return None
        return _entries(self.prefix + "datasets/", {name: found}).get(name)

    def claim(self, record: CatalogEntry, me: Registration) -> None:
        """Create a loading record on the coordinator's lease; AlreadyExists if the name is
        taken (one of two racing preloads wins); Fenced when `me` is no longer registered."""
        key = _b64(self.prefix + "datasets/" + record.name)
        fence = member_is(self.prefix, me)
        lease_id = me.lease
        won = self._txn(
            {
                "compare": [
                    {"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0},
                    fence,
                ],
                "success": [
                    {
                        "request_put": {
                            "key": key,
                            "value": _b64(json.dumps(record.to_json())),
                            "lease": lease_id,
                        }
                    }
                ],
                "failure": [],
            }
        )
        if not won:
            if not self._holds([fence]):
                raise fenced(me)
            raise AlreadyExists(f"dataset {record.name!r} is already loaded or loading")

    def update(
        self,
        name: str,
        uuid: str,
        change: Callable[[CatalogEntry], CatalogEntry | None],
        guard: list[dict[str, Any]] | None = None,
        fence: Registration | None = None,
    ) -> bool:
        """Apply `change` to the record of instance `uuid` in a transaction compared on the
        record read (retried when someone else changed it meanwhile), on `guard` and on
        `fence` still being registered (else Fenced); None from `change` deletes the record.
        False: that instance is not in the catalog, or `guard` failed."""
        key = _b64(self.prefix + "datasets/" + name)
        extra = list(guard or [])
        if fence is not None:
            extra.append(member_is(self.prefix, fence))
        for _attempt in range(20):
            found = self.dataset(name)
            if found is None or found[0].uuid != uuid:
                return False
            record, revision = found
            new = change(record)
            op: dict[str, Any] = (
                {"request_delete_range": {"key": key}}
                if new is None
                else {"request_put": {"key": key, "value": _b64(json.dumps(new.to_json()))}}
            )
            compare = {"key": key, "result": "EQUAL", "target": "MOD", "mod_revision": revision}
            if self._txn({"compare": [compare, *extra], "success": [op], "failure": []}):
                return True
            if extra and not self._holds(extra):
                if fence is not None and not self._holds([member_is(self.prefix, fence)]):
                    raise fenced(fence)
                return False
        raise NodeUnreachable(f"etcd: the record of {name} kept changing; try again")

    def remove(self, name: str, uuid: str) -> bool:
        return self.update(name, uuid, lambda _r: None)


def _entries(where: str, found: dict[str, tuple[Json, int]]) -> dict[str, tuple[CatalogEntry, int]]:
    """The catalog entries among `found` (name -> (JSON, mod revision)); a malformed one is
    logged on one line and left out (as a value that is not JSON is)."""
    out = {}
    for name, (value, revision) in found.items():
        try:
            out[name] = (CatalogEntry.from_json(value), revision)
        except ValueError as e:
            log.warning("ignoring a malformed catalog entry at %s%s: %s", where, name, e)
    return out


def fenced(me: Registration) -> Fenced:
    return Fenced(
        f"{me.address} is no longer the member registered at etcd revision {me.revision} "
        "(its lease lapsed): it joins again before it changes the catalog"
    )


def _delete(client: etcd3gw.Etcd3Client, key: str) -> bool:
    return client.delete(key)


class _PinnedSession(requests.Session):
    """A session that checks certificates against its own `verify`: requests lets
    REQUESTS_CA_BUNDLE (set on many machines) replace it, which would trust another bundle
    than tls_ca (and fail on etcd's certificate from the cluster's CA)."""

    def merge_environment_settings(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        merged: dict[str, Any] = super().merge_environment_settings(*args, **kwargs)
        merged["verify"] = self.verify
        return merged


def _tls_session(tls: tuple[Path, Path, Path] | None) -> requests.Session:
    session = _PinnedSession()
    if tls is None:
        # The system's CAs as OpenSSL finds them (SSL_CERT_FILE/SSL_CERT_DIR apply), not
        # requests' own bundle.
        paths = ssl.get_default_verify_paths()
        session.verify = paths.cafile or paths.capath or True
    else:
        cert, key, ca = tls
        session.verify = os.fspath(ca)
        session.cert = (os.fspath(cert), os.fspath(key))
    return session


def _under(e: BaseException, kind: type[E]) -> E | None:
    """The `kind` error under an etcd3gw one: requests and urllib3 keep theirs in `args` and
    `reason`, not only as a cause."""
    seen: set[int] = set()
    todo: list[object] = [e]
    while todo:
        x = todo.pop()
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, kind):
            return x
        todo += [x.__cause__, x.__context__, getattr(x, "reason", None), *x.args]
    return None


def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether host:port answers a TLS handshake (its certificate not checked: nothing is sent
    after the handshake, it only tells a plain endpoint from a TLS one)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout) as sock:
            with context.wrap_socket(sock):
                return True
    except ssl.SSLError as e:  # an alert (no client certificate): a TLS server all the same
        return not isinstance(e, ssl.SSLEOFError)
    except OSError:
        return False


def etcd_nodes(settings: Settings) -> list[Address]:
    """The live members in etcd, as node addresses (sorted: every client sees one order)."""
    members = ClusterState.of(settings).live_members()
    if not members:
        raise NodeUnreachable(f"no live kspeedfs nodes in etcd cluster {settings.cluster!r}")
    return [parse_address(a) for a in sorted(members)]


def resolve_nodes(settings: Settings, explicit: bool = False) -> Settings:
    """With etcd configured and no node list given (`explicit`), the node list is etcd's."""
    if settings.etcd and not explicit:
        settings.nodes = etcd_nodes(settings)
    return settings
