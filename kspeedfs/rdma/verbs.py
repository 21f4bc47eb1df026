"""The typed wrapper over pyverbs: device probe, memory regions, RC queue pairs, RDMA READ.

Every pyverbs call of kspeedfs is in this module. Verbs resources belong to the process that
made them: a forked child gets none of them and must never destroy them (that would destroy
the parent's, which share the same device file), so the child leaks its inherited copies on
purpose and opens its own.
"""

from __future__ import annotations

import ctypes
import dataclasses
import ipaddress
import logging
import mmap
import os
import random
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from kspeedfs.format.errors import DataError, NodeUnreachable
from kspeedfs.rdma.wire import Endpoint, gid_to_verbs

log = logging.getLogger(__name__)

SEND_DEPTH = 256  # RDMA READs one queue pair may have posted at once
# Per-hop ack timeout 4.096us * 2**14 = 67 ms, 7 retries: a dead peer is noticed in about 0.5 s.
ACK_TIMEOUT = 14
RETRY_COUNT = 7


class VerbsError(DataError):
    """A verbs call failed (device, registration, queue pair)."""


@dataclasses.dataclass(frozen=True)
class DeviceProbe:
    usable: bool
    reason: str  # why not, when not usable
    device: str = ""
    port: int = 0


def _pyverbs() -> Any:
    import pyverbs.device  # noqa: F401  (pyverbs has no stubs; everything below is Any)
    import pyverbs.enums

    return pyverbs


_probe_cache: dict[tuple[int, str, int], DeviceProbe] = {}


def probe(device: str = "", port: int = 1) -> DeviceProbe:
    """Whether this process can use RDMA: pyverbs importable, a device, its port active."""
    key = (os.getpid(), device, port)
    found = _probe_cache.get(key)
    if found is None:
        found = _probe_cache[key] = _probe(device, port)
    return found


def _probe(device: str, port: int) -> DeviceProbe:
    try:
        pv = _pyverbs()
    except ImportError as e:
        return DeviceProbe(False, f"pyverbs is not installed ({e}; see `make rdma`)")
    try:
        names = [_name(d) for d in pv.device.get_device_list()]
    except Exception as e:
        # libibverbs fails the listing itself when the kernel has no RDMA support at all.
        return DeviceProbe(False, f"no RDMA device ({e})")
    if not names:
        return DeviceProbe(False, "no RDMA device")
    if device and device not in names:
        return DeviceProbe(False, f"no RDMA device named {device!r} (found {', '.join(names)})")
    reasons = []
    for name in [device] if device else names:
        try:
            with pv.device.Context(name=name) as ctx:
                state = ctx.query_port(port).state
        except Exception as e:
            reasons.append(f"{name}: {e}")
            continue
        if state == pv.enums.IBV_PORT_ACTIVE:
            return DeviceProbe(True, "", name, port)
        reasons.append(f"{name} port {port} is not active")
    return DeviceProbe(False, "; ".join(reasons))


def _name(dev: Any) -> str:
    name = dev.name
    return name.decode() if isinstance(name, bytes) else str(name)


def has_device() -> bool:
    return probe().usable


# Every pyverbs object made in this process, so that a forked child can disown them all.
_owned: weakref.WeakSet[Any] = weakref.WeakSet()
_owned_lock = threading.Lock()


def _own(obj: Any) -> Any:
    with _owned_lock:
        _owned.add(obj)
    return obj


def _disown_after_fork() -> None:
    # In the child: one extra reference each, never dropped, so that no destructor runs here.
    global _owned_lock
    _owned_lock = threading.Lock()
    for obj in list(_owned):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    _owned.clear()
    _devices.clear()
    _probe_cache.clear()


os.register_at_fork(after_in_child=_disown_after_fork)


def buffer_address(buffer: Any) -> tuple[int, Any]:
    """The address of a buffer (an mmap, read-only or not) and an export that keeps it mapped."""
    arr = np.frombuffer(buffer, dtype=np.uint8)
    return int(arr.ctypes.data), arr


class MemoryRegion:
    """A registered memory region; `close()` deregisters it (in the process that made it)."""

    def __init__(self, mr: Any, addr: int, length: int, keep: Any):
        self._mr = mr
        self._keep = keep  # the buffer export: the memory stays mapped while registered
        self._pid = os.getpid()
        self.addr = addr
        self.length = length
        self.rkey = int(mr.rkey)
        self.lkey = int(mr.lkey)

    def close(self) -> None:
        if self._mr is not None and self._pid == os.getpid():
            self._mr.close()
        self._mr = None
        self._keep = None


def _fork_init(pv: Any) -> None:
    """On kernels that do not copy pinned pages at fork (before 5.13), keep registered memory
    out of children so that a DataLoader fork cannot turn the parent's pool copy-on-write."""
    try:
        import pyverbs.fork

        if pyverbs.fork.is_fork_initialized() == pv.enums.IBV_FORK_DISABLED:
            pyverbs.fork.fork_init()
    except Exception as e:  # too late (memory already registered) or not supported
        log.debug("ibv_fork_init: %s", e)


class Device:
    """An opened device in this process: context, protection domain, port, GID index."""

    def __init__(self, name: str, port: int = 1, gid_index: int = -1):
        pv = _pyverbs()
        import pyverbs.pd

        self.pid = os.getpid()
        self.name = name
        self.port = port
        _fork_init(pv)
        try:
            self.ctx = _own(pv.device.Context(name=name))
            self.pd = _own(pyverbs.pd.PD(self.ctx))
            self.attr = self.ctx.query_device()
            port_attr = self.ctx.query_port(port)
        except Exception as e:
            raise VerbsError(f"cannot open RDMA device {name}: {e}") from None
        self.lid = int(port_attr.lid)
        self.mtu = int(port_attr.active_mtu)
        self.ethernet = port_attr.link_layer == pv.enums.IBV_LINK_LAYER_ETHERNET
        self.gid_index, self.gid = self._pick_gid(gid_index, int(port_attr.gid_tbl_len))
        self._lock = threading.Lock()

    def _pick_gid(self, wanted: int, table_len: int) -> tuple[int, str]:
        """The configured GID index, else (RoCE) the first RoCE v2 IPv4-mapped one, else 0."""
        pv = _pyverbs()
        zero = ipaddress.IPv6Address(0)
        candidates: list[tuple[int, int, str]] = []  # (preference, index, gid)
        for index in [wanted] if wanted >= 0 else range(min(table_len, 256)):
            try:
                gid = ipaddress.IPv6Address(str(self.ctx.query_gid(self.port, index).gid))
            except Exception:
                continue
            if gid == zero:
                continue
            pref = 2
            if self.ethernet:
                try:
                    v2 = self.ctx.query_gid_type(self.port, index) == (
                        pv.enums.IBV_GID_TYPE_SYSFS_ROCE_V2
                    )
                except Exception:
                    v2 = False
                pref = 0 if v2 and gid.ipv4_mapped else (1 if v2 else 2)
            candidates.append((pref, index, str(gid)))
        if candidates:
            _, best, text = min(candidates)
            return best, text
        if self.ethernet:
            raise VerbsError(f"RDMA device {self.name} port {self.port} has no usable GID")
        return 0, "::"

    @property
    def label(self) -> str:
        return f"{self.name}:{self.port}"

    def register(self, buffer: Any, length: int) -> MemoryRegion:
        """Register memory for remote reads (a node's segment); the Registrar of a node."""
        pv = _pyverbs()
        return self._register(buffer, length, pv.enums.IBV_ACCESS_REMOTE_READ)

    def register_local(self, buffer: Any, length: int) -> MemoryRegion:
        """Register memory that RDMA READs land in (a client's receive pool)."""
        pv = _pyverbs()
        return self._register(buffer, length, pv.enums.IBV_ACCESS_LOCAL_WRITE)

    def _register(self, buffer: Any, length: int, access: int) -> MemoryRegion:
        import pyverbs.mr

        addr, keep = buffer_address(buffer)
        if length <= 0 or length > len(keep):
            raise VerbsError(f"cannot register {length} bytes of a {len(keep)}-byte buffer")
        try:
            mr = _own(pyverbs.mr.MR(self.pd, length, access, address=addr))
        except Exception as e:
            # Usually RLIMIT_MEMLOCK: registered memory is pinned.
            raise VerbsError(
                f"cannot register {length} bytes with {self.name}: {e} "
                "(is the locked-memory limit high enough? `ulimit -l`, LimitMEMLOCK=infinity)"
            ) from None
        return MemoryRegion(mr, addr, length, keep)

    def make_cq(self, depth: int) -> Any:
        import pyverbs.cq

        return _own(pyverbs.cq.CQ(self.ctx, depth, None, None, 0))

    def make_qp(self, cq: Any, depth: int) -> Any:
        pv = _pyverbs()
        import pyverbs.qp

        cap = pyverbs.qp.QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = pyverbs.qp.QPInitAttr(
            qp_type=pv.enums.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0
        )
        try:
            return _own(pyverbs.qp.QP(self.pd, init))
        except Exception as e:
            raise VerbsError(f"cannot create a queue pair on {self.name}: {e}") from None

    def endpoint(self, qp: Any, psn: int, rd_atomic: int) -> Endpoint:
        return Endpoint(
            qpn=int(qp.qp_num),
            psn=psn,
            lid=self.lid,
            gid=self.gid,
            mtu=self.mtu,
            rd_atomic=max(1, min(rd_atomic, 255)),
        )

    def connect(self, qp: Any, local_psn: int, remote: Endpoint, responder: bool) -> None:
        """Take an RC queue pair through INIT, RTR and RTS towards `remote`."""
        pv = _pyverbs()
        import pyverbs.addr
        import pyverbs.qp

        e = pv.enums
        attr = pyverbs.qp.QPAttr(port_num=self.port, path_mtu=min(self.mtu, remote.mtu))
        attr.qp_access_flags = e.IBV_ACCESS_REMOTE_READ if responder else 0
        attr.pkey_index = 0
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.sq_psn = local_psn
        # The responder answers as many reads at once as the initiator may send.
        attr.max_dest_rd_atomic = max(1, min(int(self.attr.max_qp_rd_atom), 255))
        attr.max_rd_atomic = max(1, min(int(self.attr.max_qp_init_rd_atom), remote.rd_atomic))
        attr.min_rnr_timer = 12
        attr.timeout = ACK_TIMEOUT
        attr.retry_cnt = RETRY_COUNT
        attr.rnr_retry = 7
        if remote.has_gid and (self.ethernet or self.gid != "::"):
            route = pyverbs.addr.GlobalRoute(
                dgid=pyverbs.addr.GID(gid_to_verbs(remote.gid)),
                sgid_index=self.gid_index,
                hop_limit=64,
            )
            attr.ah_attr = pyverbs.addr.AHAttr(
                dlid=remote.lid, port_num=self.port, is_global=1, gr=route
            )
        else:
            attr.ah_attr = pyverbs.addr.AHAttr(dlid=remote.lid, port_num=self.port, is_global=0)
        try:
            qp.to_rts(attr)
        except Exception as e:
            raise VerbsError(f"cannot connect a queue pair on {self.name}: {e}") from None

    def close(self) -> None:
        if self.pid == os.getpid():
            self.ctx.close()


_devices: dict[tuple[str, int, int], Device] = {}
_devices_lock = threading.Lock()


def open_device(name: str, port: int = 1, gid_index: int = -1) -> Device:
    """This process's device object, opened once (a forked child opens its own)."""
    key = (name, port, gid_index)
    with _devices_lock:
        dev = _devices.get(key)
        if dev is None or dev.pid != os.getpid():
            dev = _devices[key] = Device(name, port, gid_index)
        return dev


def new_psn() -> int:
    return random.getrandbits(24)


class ResponderQP:
    """The node's end of one client's connection: answers its RDMA READs, posts nothing."""

    def __init__(self, device: Device, cq: Any, client: Endpoint):
        self.device = device
        self._pid = os.getpid()
        self.qp = device.make_qp(cq, 1)
        self.psn = new_psn()
        try:
            device.connect(self.qp, self.psn, client, responder=True)
        except BaseException:
            self.qp.close()
            raise
        self.endpoint = device.endpoint(self.qp, self.psn, int(device.attr.max_qp_rd_atom))

    def close(self) -> None:
        if self.qp is not None and self._pid == os.getpid():
            self.qp.close()
        self.qp = None


@dataclasses.dataclass(frozen=True)
class Completion:
    wr_id: int
    ok: bool
    status: int
    text: str
    stale: bool  # the node refused the key: the region is gone (unloaded or node restarted)


@dataclasses.dataclass(frozen=True)
class ReadRequest:
    wr_id: int
    pool_offset: int
    length: int
    remote_addr: int
    rkey: int


class ReadChannel:
    """A client's RC queue pair to one node with its completion queue and receive pool."""

    def __init__(self, device: Device, pool_bytes: int, depth: int = SEND_DEPTH):
        self.device = device
        self._pid = os.getpid()
        self.depth = max(1, min(depth, int(device.attr.max_qp_wr)))
        self._pool_map = mmap.mmap(-1, pool_bytes)
        self.pool = memoryview(self._pool_map)
        self.pool_region = device.register_local(self._pool_map, pool_bytes)
        self.cq = device.make_cq(self.depth)
        self.qp = device.make_qp(self.cq, self.depth)
        self.psn = new_psn()
        self.endpoint = device.endpoint(self.qp, self.psn, int(device.attr.max_qp_init_rd_atom))
        self._wr: tuple[Any, Any] | None = None

    @property
    def pool_size(self) -> int:
        return len(self.pool)

    def connect(self, remote: Endpoint) -> None:
        self.device.connect(self.qp, self.psn, remote, responder=False)

    def post_reads(self, reads: Sequence[ReadRequest]) -> None:
        """Post RDMA READs into the pool, all before any completion is awaited."""
        if not reads:
            return
        sge, wr = self._request()
        base = self.pool_region.addr
        try:
            for r in reads:
                # The provider copies the request at posting: one request object serves all.
                sge.addr = base + r.pool_offset
                sge.length = r.length
                wr.wr_id = r.wr_id
                wr.set_wr_rdma(r.rkey, r.remote_addr)
                self.qp.post_send(wr)
        except Exception as exc:
            raise NodeUnreachable(f"cannot post RDMA reads on {self.device.name}: {exc}") from None

    def _request(self) -> tuple[Any, Any]:
        # Made once: pyverbs 44 never frees a request's memory (its destructors are misnamed),
        # so a request per read would leak; and closing them by hand would double-free on a
        # pyverbs that fixes that.
        if self._wr is None:
            pv = _pyverbs()
            import pyverbs.wr

            e = pv.enums
            sge = pyverbs.wr.SGE(self.pool_region.addr, 1, self.pool_region.lkey)
            wr = pyverbs.wr.SendWR(
                opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED
            )
            wr.sg_list = sge  # point at the SGE itself, so that changing it changes the request
            self._wr = (sge, wr)
        return self._wr

    def poll(self, max_entries: int) -> list[Completion]:
        pv = _pyverbs()
        import pyverbs.cq

        e = pv.enums
        n, wcs = self.cq.poll(max_entries)
        out = []
        for wc in wcs[:n]:
            status = int(wc.status)
            out.append(
                Completion(
                    wr_id=int(wc.wr_id),
                    ok=status == e.IBV_WC_SUCCESS,
                    status=status,
                    text=str(pyverbs.cq.cqe_status_to_str(status)),
                    stale=status in (e.IBV_WC_REM_ACCESS_ERR, e.IBV_WC_REM_INV_REQ_ERR),
                )
            )
        return out

    def close(self) -> None:
        if self._pid != os.getpid():
            return
        for obj in (self.qp, self.cq):
            if obj is not None:
                obj.close()
        self.qp = self.cq = None
        self.pool_region.close()
        self.pool.release()
        self._pool_map.close()
