"""`kspeedfs csi`: the CSI node plugin, Identity and Node services of CSI v1 over grpcio.

kubelet calls it on a unix socket (registered by the node-driver-registrar sidecar): a pod's
inline volume or PV of driver csi.kspeedfs.io is published by mounting its dataset read-only at
the target path kubelet gives, through mountd (mounts.py: the mounts outlive the plugin), warm
(warm.py: a source not cached is loaded first). Every call is idempotent and keeps kubelet's
order free: publish and unpublish of one target are serialized, of different targets not.

Why grpcio with a module generated from the spec's own csi.proto (the subset served, field
numbers kept) and committed: the messages are checked by protobuf itself, kubelet's fields we
do not read are skipped as protobuf skips any unknown field, and nothing is generated at
install or run time (grpcio-tools is only needed to change the proto). The services are
registered as generic handlers over the generated messages (no *_pb2_grpc module to keep).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from kspeedfs import __version__
from kspeedfs.format.config import Settings
from kspeedfs.format.errors import (
    AlreadyExists,
    AuthError,
    InvalidArgument,
    KSpeedError,
    NodeUnreachable,
    NotFound,
)
from kspeedfs.system.mountinfo import clear_stale, kspeedfs_mounted

from . import csi_pb2 as pb
from .mounts import MountdLink, MountdUnavailable
from .policy import NotAllowed, VolumePolicy
from .volumes import DRIVER_NAME, Volume, VolumeRecords, volume_from_request
from .warm import LeaseRenewer, NotResident, WarmDatasets

log = logging.getLogger(__name__)

# kubelet gives a NodePublishVolume 2 minutes (csiTimeout): answer before it gives up.
DEFAULT_PUBLISH_TIMEOUT = 110.0
UNMOUNT_TIMEOUT = 60.0

# One-line errors to the spec's codes; the first class that matches wins.
ERROR_CODES: list[tuple[type[KSpeedError], grpc.StatusCode]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (NotResident, grpc.StatusCode.DEADLINE_EXCEEDED),
    (MountdUnavailable, grpc.StatusCode.UNAVAILABLE),
    (NodeUnreachable, grpc.StatusCode.UNAVAILABLE),
    (AuthError, grpc.StatusCode.PERMISSION_DENIED),
    (NotAllowed, grpc.StatusCode.PERMISSION_DENIED),
    (KSpeedError, grpc.StatusCode.INTERNAL),
]


class VolumeConflict(AlreadyExists):
    """Another volume (or the same one, asked for differently) is published at that target."""


class NodePlugin:
    """The Node and Identity calls over the volume records, mountd and the node."""

    def __init__(
        self,
        node_id: str,
        settings: Settings,
        state_dir: Path,
        mounts_dir: Path,
        mountd_state: Path,
        publish_timeout: float = DEFAULT_PUBLISH_TIMEOUT,
        kubelet_dir: Path = Path("/var/lib/kubelet"),
        policy: Path | None = None,
    ):
        self.node_id = node_id
        self.kubelet_dir = os.path.normpath(kubelet_dir)
        self.policy = VolumePolicy(policy)
        self.settings = settings
        self.records = VolumeRecords(state_dir / "volumes")
        self.mounts = MountdLink(mounts_dir, mountd_state, settings)
        self.warm = WarmDatasets(settings, node_id)
        self.publish_timeout = publish_timeout
        self._records_lock = threading.Lock()
        self._target_locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self.renewer = LeaseRenewer(self.warm, self.records, self._records_lock)

    @contextlib.contextmanager
    def _target(self, target: str) -> Iterator[None]:
        with self._locks_lock:
            lock = self._target_locks.setdefault(os.path.normpath(target), threading.Lock())
        with lock:
            yield

    def adopt(self) -> int:
        """On start, before listening: the volumes published before (by this plugin's last
        run) declared to mountd again if it lost them; the records of pods that are gone
        dropped. Their leases are renewed once it listens (LeaseRenewer). Returns how many
        volumes it kept."""
        kept = 0
        for volume in self.records.all():
            if not os.path.isdir(os.path.dirname(volume.target)):
                # kubelet removed the pod's folder (the pod is gone, its unpublish never
                # came: a reboot): declaring it again would make the folder and mount a
                # dataset for nobody, and keep its lease, for ever.
                self._forget(volume)
                continue
            kept += 1
            try:
                if not self.mounts.declared(volume.target):
                    log.warning("volume %s: declaring it to mountd again", volume.volume_id)
                    self.mounts.declare(volume)
            except KSpeedError as e:
                log.error("volume %s: %s", volume.volume_id, e)
        log.info("adopted %d published volumes", kept)
        return kept

    def _forget(self, volume: Volume) -> None:
        """Drop a gone pod's volume: its declaration, its lease (in the background: the node
        may be slow, and nothing waits for it) and its record."""
        log.warning(
            "volume %s: its pod's folder %s is gone: dropping its record",
            volume.volume_id, os.path.dirname(volume.target),
        )  # fmt: skip
        try:
            if self.mounts.declared(volume.target):
                self.mounts.withdraw(volume.target)
        except KSpeedError as e:
            log.error("volume %s: %s", volume.volume_id, e)
        with self._records_lock:
            self.records.remove(volume.target)
        if volume.lease:
            threading.Thread(target=self._release, args=(volume,), daemon=True).start()

    def _release(self, volume: Volume) -> None:
        try:
            self.warm.release(volume)
        except KSpeedError as e:
            log.warning("volume %s: its lease is left to expire: %s", volume.volume_id, e)

    # Identity

    def get_plugin_info(self, request: Any) -> pb.GetPluginInfoResponse:
        return pb.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    def get_plugin_capabilities(self, request: Any) -> pb.GetPluginCapabilitiesResponse:
        # A node-only plugin: no controller service, no topology constraints.
        return pb.GetPluginCapabilitiesResponse()

    def probe(self, request: Any) -> pb.ProbeResponse:
        response = pb.ProbeResponse()
        try:
            self.mounts.entry("/")  # mountd's status file is there and its process alive
            ready = True
        except MountdUnavailable as e:
            log.warning("probe: not ready: %s", e)
            ready = False
        response.ready.value = ready
        return response

    # Node

    def node_get_info(self, request: Any) -> pb.NodeGetInfoResponse:
        return pb.NodeGetInfoResponse(node_id=self.node_id)

    def node_get_capabilities(self, request: Any) -> pb.NodeGetCapabilitiesResponse:
        rpc = pb.NodeServiceCapability.RPC(type=pb.NodeServiceCapability.RPC.GET_VOLUME_STATS)
        return pb.NodeGetCapabilitiesResponse(capabilities=[pb.NodeServiceCapability(rpc=rpc)])

    def node_publish_volume(self, request: pb.NodePublishVolumeRequest) -> Any:
        context = dict(request.volume_context)
        volume = volume_from_request(
            request.volume_id, request.target_path, context, request.readonly
        )
        if not volume.target.startswith(self.kubelet_dir.rstrip("/") + "/"):
            raise InvalidArgument(
                f"target_path {volume.target} is not under kubelet's folder {self.kubelet_dir} "
                f"(the plugin's --kubelet-dir)"
            )
        if not request.HasField("volume_capability"):
            raise InvalidArgument("volume_capability is missing")
        if request.volume_capability.HasField("block"):
            raise InvalidArgument("kspeedfs volumes are filesystems, not block devices")
        deadline = time.monotonic() + self.publish_timeout
        with self._target(volume.target):
            known = self.records.get(volume.target)
            if known is not None:
                if not known.compatible(volume):
                    raise VolumeConflict(
                        f"{volume.target} already publishes volume {known.volume_id} "
                        f"(dataset {known.mounted}), not this one"
                    )
                volume = known  # the same volume again: make sure it is mounted, answer OK
            else:
                grant = self.policy.check(volume, context)
                volume = self.warm.prepare(volume, self.publish_timeout, grant.may_load)
                with self._records_lock:
                    self.records.put(volume)  # before the mount: a restart finds the lease
            try:
                self.mounts.declare(volume)
                self.mounts.wait_mounted(volume, max(deadline - time.monotonic(), 1.0))
            except KSpeedError:
                if known is None:
                    self._withdraw(volume)
                raise
        log.info(
            "published %s (%s) at %s for %s",
            volume.volume_id, volume.mounted, volume.target, volume.pod or "a pod",
        )  # fmt: skip
        return pb.NodePublishVolumeResponse()

    def node_unpublish_volume(self, request: pb.NodeUnpublishVolumeRequest) -> Any:
        if not request.volume_id:
            raise InvalidArgument("volume_id is missing")
        if not request.target_path:
            raise InvalidArgument("target_path is missing")
        target = os.path.normpath(request.target_path)
        with self._target(target):
            known = self.records.get(target)
            if known is not None and known.volume_id != request.volume_id:
                raise NotFound(f"volume {request.volume_id} is not the one published at {target}")
            if known is not None:
                self._withdraw(known)
            elif self.mounts.declared(target):  # a publish killed before its record was written
                self.mounts.withdraw(target)
                self.mounts.wait_unmounted(target, UNMOUNT_TIMEOUT)
            _remove_target(target)
        log.info("unpublished %s at %s", request.volume_id, target)
        return pb.NodeUnpublishVolumeResponse()

    def _withdraw(self, volume: Volume) -> None:
        """Unmount (mountd), end the lease, forget the record: in this order, so that a plugin
        killed half way finds the rest to do at kubelet's next call."""
        self.mounts.withdraw(volume.target)
        self.mounts.wait_unmounted(volume.target, UNMOUNT_TIMEOUT)
        self.warm.release(volume)
        with self._records_lock:
            self.records.remove(volume.target)

    def node_get_volume_stats(self, request: pb.NodeGetVolumeStatsRequest) -> Any:
        if not request.volume_id:
            raise InvalidArgument("volume_id is missing")
        if not request.volume_path:
            raise InvalidArgument("volume_path is missing")
        known = self.records.get(request.volume_path)
        if known is None or known.volume_id != request.volume_id:
            raise NotFound(f"volume {request.volume_id} is not published at {request.volume_path}")
        if not kspeedfs_mounted(known.target):
            raise NotFound(f"volume {known.volume_id} is not mounted at {known.target} now")
        st = os.statvfs(known.target)
        usage = pb.VolumeUsage
        total, free = st.f_blocks * st.f_frsize, st.f_bfree * st.f_frsize
        return pb.NodeGetVolumeStatsResponse(
            usage=[
                usage(
                    unit=usage.BYTES,
                    total=total,
                    used=total - free,
                    available=st.f_bavail * st.f_frsize,
                ),
                usage(
                    unit=usage.INODES,
                    total=st.f_files,
                    used=st.f_files - st.f_ffree,
                    available=st.f_favail,
                ),
            ]
        )


def _remove_target(target: str) -> None:
    """kubelet expects the target gone after unpublish; a stale leftover is unmounted first."""
    try:
        clear_stale(target)
    except KSpeedError as e:
        log.warning("%s", e)
    try:
        os.rmdir(target)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise KSpeedError(f"cannot remove the target {target}: {e.strerror}") from None


def _handler(call: Callable[[Any], Any], name: str) -> Callable[[Any, grpc.ServicerContext], Any]:
    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return call(request)
        except KSpeedError as e:
            code = next(c for cls, c in ERROR_CODES if isinstance(e, cls))
            message = " ".join(str(e).split())
            log.warning("%s: %s: %s", name, code.name, message)
            context.abort(code, message)
        except OSError as e:
            log.warning("%s: %s", name, e)
            context.abort(grpc.StatusCode.INTERNAL, f"{name}: {e.strerror or e}")
        except Exception as e:  # a bug: one line to kubelet, the traceback in our log
            log.exception("%s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error: {e!r}")

    return handle


# Each service: its full name, and per method the request type and the plugin's method.
SERVICES: dict[str, dict[str, tuple[type[Any], type[Any], str]]] = {
    "csi.v1.Identity": {
        "GetPluginInfo": (pb.GetPluginInfoRequest, pb.GetPluginInfoResponse, "get_plugin_info"),
        "GetPluginCapabilities": (
            pb.GetPluginCapabilitiesRequest,
            pb.GetPluginCapabilitiesResponse,
            "get_plugin_capabilities",
        ),
        "Probe": (pb.ProbeRequest, pb.ProbeResponse, "probe"),
    },
    "csi.v1.Node": {
        "NodeGetInfo": (pb.NodeGetInfoRequest, pb.NodeGetInfoResponse, "node_get_info"),
        "NodeGetCapabilities": (
            pb.NodeGetCapabilitiesRequest,
            pb.NodeGetCapabilitiesResponse,
            "node_get_capabilities",
        ),
        "NodePublishVolume": (
            pb.NodePublishVolumeRequest,
            pb.NodePublishVolumeResponse,
            "node_publish_volume",
        ),
        "NodeUnpublishVolume": (
            pb.NodeUnpublishVolumeRequest,
            pb.NodeUnpublishVolumeResponse,
            "node_unpublish_volume",
        ),
        "NodeGetVolumeStats": (
            pb.NodeGetVolumeStatsRequest,
            pb.NodeGetVolumeStatsResponse,
            "node_get_volume_stats",
        ),
    },
}


def handlers(plugin: NodePlugin) -> list[grpc.GenericRpcHandler]:
    out = []
    for service, methods in SERVICES.items():
        table = {
            method: grpc.unary_unary_rpc_method_handler(
                _handler(getattr(plugin, attr), method),
                request_deserializer=request.FromString,
                response_serializer=response.SerializeToString,
            )
            for method, (request, response, attr) in methods.items()
        }
        out.append(grpc.method_handlers_generic_handler(service, table))
    return out


def socket_path(endpoint: str) -> Path:
    """The path of a `unix:///PATH` endpoint (CSI's CSI_ENDPOINT form)."""
    for prefix in ("unix://", "unix:"):
        if endpoint.startswith(prefix):
            path = endpoint[len(prefix) :]
            if path.startswith("/"):
                return Path(path)
    raise InvalidArgument(f"--endpoint must be unix:///ABSOLUTE/PATH, not {endpoint!r}")


def serve(plugin: NodePlugin, endpoint: str, workers: int = 8) -> None:
    """Serve until SIGTERM or SIGINT; a socket left by a killed plugin is replaced."""
    path = socket_path(endpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    plugin.adopt()  # local only (records, mountd's folder): no network before it listens
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    server.add_generic_rpc_handlers(handlers(plugin))
    if not server.add_insecure_port(f"unix://{path}"):
        raise KSpeedError(f"cannot listen on {path}")
    server.start()
    plugin.renewer.start()  # renews at once, then a third of the ttl apart
    log.info("CSI node plugin %s for node %s on %s", DRIVER_NAME, plugin.node_id, path)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    log.info("stopping (published volumes stay mounted: mountd holds them)")
    plugin.renewer.stop()
    server.stop(grace=5).wait()
