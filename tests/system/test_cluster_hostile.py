"""Hostile input on a live node daemon: bad frames, bad requests, reads past the end, path
traversal, random frames (hypothesis). Each connection is closed or its request refused; the
daemon keeps serving valid clients and its memory does not grow."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import NodeProcess, make_tree, run_cli, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.format import auth, protocol
from kspeedfs.format.protocol import HEADER, MAX_CONTROL_PAYLOAD, MAX_PAYLOAD, MsgType
from kspeedfs.node.server import HANDSHAKE_TIMEOUT
from kspeedfs.system.local_dataset import LocalDataset

SEGMENT = 64 * 1024
DATASET = "victim"


class Node:
    """The daemon under attack, with what a valid client should read back from it."""

    def __init__(self, proc: NodeProcess, shm_root: Path):
        self.proc = proc
        self.shm_root = shm_root
        self.dataset_dir = proc.shm_dir / "datasets" / DATASET
        self.seg0 = (self.dataset_dir / "seg" / "00000000").read_bytes()
        self.uuid = LocalDataset(self.dataset_dir).uuid
        self.admin = auth.read_token(proc.token_file)
        self.read = auth.derive_read_token(self.admin)

    def assert_serves(self) -> None:
        assert self.proc.proc is not None and self.proc.proc.poll() is None, "daemon died"
        with self.proc.client() as c:
            assert c.request("ping")["node"] == self.proc.address
            uuid = c.request("list")["datasets"][0]["uuid"]
            assert bytes(c.read(DATASET, uuid, [(0, 5, 100), (0, 0, 5)])) == (
                self.seg0[5:105] + self.seg0[:5]
            )
            assert [d["name"] for d in c.request("list")["datasets"]] == [DATASET]

    def rss(self) -> int:
        assert self.proc.proc is not None
        return int(psutil.Process(self.proc.proc.pid).memory_info().rss)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("hostile")
    token_file = tmp / "token"
    auth.write_token(token_file, auth.new_admin_token())
    shm = Path("/dev/shm") / f"kspeedfs-test-hostile-{os.getpid()}"
    proc = NodeProcess(shm / "node", token_file, tmp, segment_size="64KiB")
    try:
        proc.start()
        done = run_cli(
            "preload",
            str(make_tree(tmp / "src", SEGMENT)),
            "--name",
            DATASET,
            "-q",
            env=proc.env(),
        )
        assert done.returncode == 0, done.stderr
        yield Node(proc, shm)
    finally:
        proc.stop()
        import shutil

        shutil.rmtree(shm, ignore_errors=True)


class Raw:
    """A raw socket to the daemon, optionally through the handshake with a real token."""

    def __init__(
        self, node: Node, token: str | None = None, role: str | None = None, timeout: float = 10
    ):
        self.sock = socket.create_connection(("127.0.0.1", node.proc.port), timeout=timeout)
        kind, hello = self.reply_json()
        assert kind == MsgType.HELLO
        if token is not None:
            nonce = bytes.fromhex(str(hello["nonce"]))
            answer, _ = auth.client_answer(token, auth.TCP, nonce)
            answer["role"] = role or answer["role"]
            self.send(protocol.encode_json(MsgType.AUTH, 0, answer))
            kind, _ = self.reply_json()
            assert kind == MsgType.RESPONSE

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> bool:
        """False when the daemon already closed the connection."""
        try:
            self.sock.sendall(data)
            return True
        except (BrokenPipeError, ConnectionResetError):
            return False

    def _exact(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def reply(self) -> tuple[MsgType, bytes] | None:
        """The next frame, or None when the daemon closed the connection."""
        header = self._exact(protocol.HEADER_SIZE)
        if header is None:
            return None
        kind, _rid, length = protocol.parse_header(header)
        payload = self._exact(length)
        assert payload is not None, "daemon closed the connection inside a frame"
        return kind, payload

    def reply_json(self) -> tuple[MsgType, dict[str, object]]:
        got = self.reply()
        assert got is not None, "connection closed"
        return got[0], protocol.decode_json(got[1])

    def closed(self) -> bool:
        """Reads to the end: True when the daemon closes without sending anything more."""
        return self.reply() is None

    def request(self, obj: dict[str, object], rid: int = 1) -> dict[str, object]:
        self.send(protocol.encode_json(MsgType.REQUEST, rid, obj))
        kind, msg = self.reply_json()
        assert kind == MsgType.ERROR, (kind, msg)
        return msg


def frame(
    msg_type: int,
    payload: bytes = b"",
    length: int | None = None,
    magic: bytes = b"KS",
    version: int = protocol.VERSION,
) -> bytes:
    n = len(payload) if length is None else length
    return HEADER.pack(magic, version, msg_type, 1, n) + payload


OTHER_INSTANCE = "0" * 32


def read_payload(
    name: str, ranges: list[tuple[int, int, int]], instance: str = OTHER_INSTANCE
) -> bytes:
    return frame(MsgType.READ, protocol.encode_read(name, instance, ranges))


# Bytes that make the daemon close the connection, with or without a reply first.
CLOSING = {
    "truncated header": b"KS\x01\x03",
    "truncated payload": frame(MsgType.REQUEST, b'{"op":"pi', length=100),
    "wrong magic": frame(MsgType.REQUEST, b'{"op":"ping"}', magic=b"HT"),
    "http": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "wrong version": frame(MsgType.REQUEST, b'{"op":"ping"}', version=protocol.VERSION + 1),
    "version zero": frame(MsgType.REQUEST, b'{"op":"ping"}', version=0),
    "oversize control": frame(MsgType.REQUEST, length=MAX_CONTROL_PAYLOAD + 1),
    "oversize data": frame(MsgType.DATA, length=MAX_PAYLOAD),
    "oversize beyond all": frame(MsgType.READ, length=2**32 - 1),
    "unknown type": frame(99, b"{}"),
    "type zero": frame(0, b"{}"),
    "response from a client": frame(MsgType.RESPONSE, b"{}"),
    "data from a client": frame(MsgType.DATA, b"abc"),
    "hello from a client": frame(MsgType.HELLO, b"{}"),
    "second auth": frame(MsgType.AUTH, b'{"role":"admin","mac":"00"}'),
    "malformed json": frame(MsgType.REQUEST, b'{"op": "ping"'),
    "json not an object": frame(MsgType.REQUEST, b'["ping"]'),
    "not utf-8": frame(MsgType.REQUEST, b'{"op": "\xff\xfe"}'),
    "read shorter than its ranges": frame(
        MsgType.READ, protocol.encode_read(DATASET, "0" * 32, [(0, 0, 1)])[:-3]
    ),
    "read name past the payload": frame(
        MsgType.READ, struct.pack("!B16sI", 200, bytes(16), 0) + b"abc"
    ),
    "read too many ranges": frame(MsgType.READ, struct.pack("!B16sI", 1, bytes(16), 70000) + b"v"),
    "read of more than the maximum": read_payload(DATASET, [(0, 0, MAX_PAYLOAD), (0, 0, 1)]),
    "read name not utf-8": frame(
        MsgType.READ, struct.pack("!B16sI", 2, bytes(16), 0) + b"\xff\xfe"
    ),
}


@pytest.mark.parametrize("case", sorted(CLOSING))
def test_bad_frames_close_the_connection(node: Node, case: str) -> None:
    for token in (node.admin, None):  # after and before the handshake
        # Well within the handshake timeout: the daemon must not wait for the rest of an
        # oversize or broken frame (a stranger could hold its memory that long).
        with Raw(node, token, timeout=HANDSHAKE_TIMEOUT / 2) as raw:
            raw.send(CLOSING[case])
            if case.startswith("truncated"):
                raw.sock.shutdown(socket.SHUT_WR)
            while (got := raw.reply()) is not None:
                assert got[0] == MsgType.ERROR, (case, got)
    node.assert_serves()


# Requests the daemon refuses with an error while the connection carries on.
# (dataset, ranges, whether the read names the instance the node holds, the error's kind)
REFUSED: dict[str, tuple[str, list[tuple[int, int, int]], bool, str]] = {
    "past the segment end": (DATASET, [(0, SEGMENT - 10, 100)], True, "DataError"),
    "offset past the end": (DATASET, [(0, 2**40, 1)], True, "DataError"),
    "segment that does not exist": (DATASET, [(2**32 - 1, 0, 1)], True, "DataError"),
    "another instance": (DATASET, [(0, 0, 1)], False, "StaleDataset"),
    "unknown dataset": ("nope", [(0, 0, 1)], True, "NotFound"),
    "traversal in a read": ("../victim", [(0, 0, 1)], True, "NotFound"),
    "absolute name in a read": ("/etc/passwd", [(0, 0, 1)], True, "NotFound"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_bad_reads_are_refused_and_the_connection_carries_on(node: Node, case: str) -> None:
    name, ranges, held, kind = REFUSED[case]
    data = read_payload(name, ranges, node.uuid if held else OTHER_INSTANCE)
    with Raw(node, node.read) as raw:
        for _ in range(2):
            raw.send(data)
            got = raw.reply()
            assert got is not None and got[0] == MsgType.ERROR, case
            assert json.loads(got[1])["kind"] == kind
        # The same connection still reads.
        raw.send(read_payload(DATASET, [(0, 0, 10)], node.uuid))
        assert raw.reply() == (MsgType.DATA, node.seg0[:10])
    node.assert_serves()


BAD_NAMES = ["../x", "../../etc", "..", ".", "", "a/b", "/abs", "UPPER", "x" * 65, "ok\n", "a\0b"]


def test_path_traversal_and_bad_requests_are_refused(node: Node) -> None:
    shm_before = sorted(p.relative_to(node.shm_root) for p in node.shm_root.rglob("*"))
    src = str(node.dataset_dir.parent.parent.parent)
    with Raw(node, node.admin) as raw:
        for name in BAD_NAMES:
            for op, extra in (
                ("manifest", {}),
                ("progress", {}),
                ("unload", {}),
                ("unload_local", {}),
                ("preload", {"source": src}),
                ("lease_acquire", {}),
                ("abort", {"uuid": "u"}),
            ):
                err = raw.request({"op": op, "name": name, **extra})
                assert err["kind"] == "InvalidArgument" and "bad dataset name" in str(
                    err["message"]
                ), (op, name, err)
        # Wrong types and missing fields: a one-line refusal, not a dropped connection.
        bad_requests: list[dict[str, object]] = [
            {"op": 5},
            {"op": "format_disk"},
            {"op": "manifest", "name": ["victim"]},
            {"op": "manifest", "name": {"$ne": 1}},
            {"op": "preload", "name": "fine", "source": src, "replicas": "many"},
            {"op": "preload", "name": "fine", "source": "relative/path"},
            {"op": "preload", "name": "fine", "source": src, "replicas": 0},
            {"op": "preload", "name": "fine", "source": src, "lifetime": "forever"},
            {"op": "stage", "name": "fine"},
            {"op": "stage", "name": "fine", "uuid": "u", "push": True, "seg_len": {"0": -5}},
            {"op": "stage_put", "name": "victim", "uuid": "u", "segment": "x"},
            {"op": "commit", "name": "victim"},
            {"op": "lease_renew", "lease": None},
        ]
        for bad in bad_requests:
            err = raw.request(bad)
            assert err["kind"] in {"InvalidArgument", "NotFound", "SourceNotVisible"}, (bad, err)
            assert "\n" not in str(err["message"]) and "Traceback" not in str(err["message"])
        raw.send(protocol.encode_json(MsgType.REQUEST, 9, {"op": "ping"}))
        assert raw.reply_json()[0] == MsgType.RESPONSE
    shm_after = sorted(p.relative_to(node.shm_root) for p in node.shm_root.rglob("*"))
    assert shm_after == shm_before
    assert not (node.shm_root / "x").exists() and not (node.shm_root.parent / "x").exists()
    assert "Traceback" not in node.proc.log()
    node.assert_serves()


def hostile_round(node: Node) -> None:
    for case in sorted(CLOSING):
        with Raw(node, node.read) as raw:
            raw.send(CLOSING[case])
            if case.startswith("truncated"):
                raw.sock.shutdown(socket.SHUT_WR)
            while raw.reply() is not None:
                pass
    for name, ranges, held, _kind in REFUSED.values():
        with Raw(node, node.read) as raw:
            raw.send(read_payload(name, ranges, node.uuid if held else OTHER_INSTANCE))
            raw.reply()


def test_memory_does_not_grow(node: Node) -> None:
    hostile_round(node)  # warm up: first-use allocations are not growth
    node.assert_serves()
    base = node.rss()

    def back_to_base() -> bool:
        # The daemon frees a dropped connection's buffer once it has read to its end.
        return node.rss() - base < 16 << 20

    for _ in range(15):
        hostile_round(node)
    wait_for(back_to_base, timeout=15, what="daemon RSS back near its start after hostile rounds")
    # Strangers claiming big frames: refused at the header, before any of the body arrives.
    for _ in range(32):
        with Raw(node) as raw:
            raw.send(frame(MsgType.AUTH, length=MAX_CONTROL_PAYLOAD))
            assert raw.closed()
    # Authenticated clients that send most of a big frame, then vanish: the buffers go too.
    threads = []
    for _ in range(6):
        raw = Raw(node, node.read)
        body = b"\x20" * (MAX_CONTROL_PAYLOAD - 100)

        def send_and_drop(raw: Raw = raw, body: bytes = body) -> None:
            raw.send(frame(MsgType.REQUEST, length=MAX_CONTROL_PAYLOAD) + body)
            raw.sock.close()

        threads.append(threading.Thread(target=send_and_drop))
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    node.assert_serves()
    wait_for(back_to_base, timeout=15, what="daemon RSS back near its start after big frames")


def header_fields() -> st.SearchStrategy[bytes]:
    return st.builds(
        lambda magic, version, kind, rid, length: HEADER.pack(magic, version, kind, rid, length),
        st.sampled_from([b"KS", b"KS", b"KS", b"SK", b"\0\0"]),
        st.sampled_from([protocol.VERSION] * 4 + [0, protocol.VERSION + 1, 255]),
        st.integers(0, 9) | st.integers(0, 255),
        st.integers(0, 2**32 - 1),
        st.integers(0, 64) | st.integers(0, 2**32 - 1),
    )


json_ops = st.fixed_dictionaries(
    {
        "op": st.sampled_from(
            ["ping", "status", "list", "progress", "manifest", "lease_renew", "unload", "stage"]
        )
    },
    optional={
        "name": st.sampled_from([DATASET, "../x", "", "nope"]) | st.text(max_size=8),
        "lease": st.text(max_size=8) | st.integers(),
        "uuid": st.text(max_size=4),
    },
).map(lambda d: frame(MsgType.REQUEST, json.dumps(d).encode()))

reads = st.lists(
    st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**20)),
    max_size=4,
).map(lambda rs: read_payload(DATASET, [(s % 4, o % (SEGMENT * 2), n) for s, o, n in rs]))

chunks = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda h, p: h + p, header_fields(), st.binary(max_size=64)),
    json_ops,
    reads,
)


@pytest.mark.slow  # 120 hypothesis examples at a live node
@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(authenticated=st.booleans(), parts=st.lists(chunks, max_size=6))
def test_random_frames_then_a_valid_client_is_served(
    node: Node, authenticated: bool, parts: list[bytes]
) -> None:
    # The read role: random admin requests would be refused anyway, and must not be tried
    # for real (a random but valid "shutdown" would be no finding).
    with Raw(node, node.read if authenticated else None) as raw:
        for part in parts:
            if not raw.send(part):
                break
        try:
            raw.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        # Every answer is a well-formed frame, and the daemon ends the connection.
        while (got := raw.reply()) is not None:
            assert got[0] in (MsgType.RESPONSE, MsgType.ERROR, MsgType.DATA)
    node.assert_serves()
