"""The CSI node plugin as kubelet drives it: calls in kubelet's order on a unix socket, pods in
mount namespaces of their own reading with stock ImageFolder, warm volumes, and the plugin
killed with SIGKILL while a pod reads."""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import MountProcess, NodeProcess, make_tree, preload, wait_for
from decoded_images import make_images
from hypothesis import given
from hypothesis import strategies as st

from kspeedfs.csi import csi_pb2 as pb
from kspeedfs.csi.harness import (
    BUSYBOX,
    CsiClient,
    MountdDaemon,
    PluginDaemon,
    busybox_root,
    container_command,
    inline_context,
    pod_command,
    run_pod,
)
from kspeedfs.csi.volumes import (
    ATTRIBUTES,
    POD_PREFIX,
    Volume,
    VolumeRecords,
    volume_from_request,
)
from kspeedfs.format import auth
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.sample import make_sample
from kspeedfs.system.mountinfo import kspeedfs_mounted, lazy_unmount
from kspeedfs.testing.readgap import ContainerReader, container_loop

CSI_DIR = Path(__file__).parents[2] / "kspeedfs" / "csi"

# The pod's ImageFolder: every sample's path (relative), class and the sha256 of its bytes.
IMAGEFOLDER = """
import hashlib, json, sys
from torchvision.datasets import ImageFolder
root = sys.argv[1]
ds = ImageFolder(root, loader=lambda p: open(p, "rb").read())
out = [(p[len(root) + 1:], c, hashlib.sha256(ds[i][0]).hexdigest()) for i, (p, c) in enumerate(ds.samples)]
print(json.dumps({"classes": ds.classes, "samples": out}))
"""


def imagefolder_here(root: Path) -> dict[str, object]:
    """What IMAGEFOLDER prints, computed in this process on `root` (the source)."""
    out = subprocess.run(
        [sys.executable, "-c", IMAGEFOLDER, str(root)], capture_output=True, text=True, check=True
    ).stdout
    return dict(json.loads(out))


# Pure parts: the proto module, the request checks.


def test_generated_module_is_the_protos(tmp_path: Path) -> None:
    protoc = pytest.importorskip("grpc_tools.protoc")
    well_known = Path(protoc.__file__).parent / "_proto"  # google/protobuf/wrappers.proto
    code = protoc.main(
        [
            "protoc",
            f"-I{CSI_DIR}",
            f"-I{well_known}",
            f"--python_out={tmp_path}",
            str(CSI_DIR / "csi.proto"),
        ]
    )
    assert code == 0
    assert filecmp.cmp(tmp_path / "csi_pb2.py", CSI_DIR / "csi_pb2.py", shallow=False), (
        "kspeedfs/csi/csi_pb2.py is stale: regenerate it (see csi.proto)"
    )


def test_spec_field_numbers() -> None:
    """The fields kubelet sends, by the numbers of the spec's csi.proto (v1.x)."""
    expected = {
        "NodePublishVolumeRequest": {
            "volume_id": 1,
            "publish_context": 2,
            "staging_target_path": 3,
            "target_path": 4,
            "volume_capability": 5,
            "readonly": 6,
            "secrets": 7,
            "volume_context": 8,
        },
        "NodeUnpublishVolumeRequest": {"volume_id": 1, "target_path": 2},
        "NodeGetVolumeStatsRequest": {"volume_id": 1, "volume_path": 2, "staging_target_path": 3},
        "VolumeCapability": {"block": 1, "mount": 2, "access_mode": 3},
        "NodeGetInfoResponse": {"node_id": 1, "max_volumes_per_node": 2, "accessible_topology": 3},
        "GetPluginInfoResponse": {"name": 1, "vendor_version": 2, "manifest": 3},
        "ProbeResponse": {"ready": 1},
        "VolumeUsage": {"available": 1, "total": 2, "used": 3, "unit": 4},
    }
    for message, fields in expected.items():
        descriptor = getattr(pb, message).DESCRIPTOR
        assert descriptor.full_name == f"csi.v1.{message}"
        assert {f.name: f.number for f in descriptor.fields} == fields


def test_request_checks() -> None:
    ctx = inline_context("imagenet", source="/data/imagenet", lifetime="persistent")
    v = volume_from_request("csi-abc", "/var/lib/kubelet/pods/x/mount/", ctx, True)
    assert (v.dataset, v.source, v.lifetime, v.ephemeral, v.pod) == (
        "imagenet",
        "/data/imagenet",
        "persistent",
        True,
        "default/trainer",
    )
    assert v.target == "/var/lib/kubelet/pods/x/mount"
    pv = volume_from_request("imagenet", "/t", {}, False)  # a PV: the handle names the dataset
    assert (pv.dataset, pv.ephemeral) == ("imagenet", False)
    decoded = volume_from_request("v", "/t", {"dataset": "ok", "decoded": "256"}, True)
    assert (decoded.dataset, decoded.decoded, decoded.mounted) == ("ok", 256, "ok@256")
    assert volume_from_request("v", "/t", {"dataset": "ok", "decoded": "0"}, True).mounted == "ok"
    assert (pv.dataset, pv.ephemeral) == ("imagenet", False)
    for volume_id, target, context, why in [
        ("", "/t", {}, "volume_id"),
        ("v", "", {}, "target_path"),
        ("v", "rel/path", {}, "absolute"),
        ("v", "/t", {"dataset": "Bad Name"}, "dataset"),
        ("v", "/t", {"dataset": "ok", "lifetime": "forever"}, "lifetime"),
        ("v", "/t", {"dataset": "ok", "decoded": "-1"}, "decoded"),
        ("v", "/t", {"dataset": "ok", "decoded": "4097"}, "decoded"),
        ("v", "/t", {"dataset": "ok", "source": "relative"}, "source"),
        ("v", "/t", {"dataset": "ok", "colour": "red"}, "unknown volume attribute"),
        ("v", "/t", {POD_PREFIX + "ephemeral": "true"}, "needs the attribute dataset"),
    ]:
        with pytest.raises(InvalidArgument, match=why):
            volume_from_request(volume_id, target, context, True)


@given(
    st.text(max_size=30),
    st.text(max_size=40),
    st.dictionaries(
        st.sampled_from(sorted(ATTRIBUTES) + [POD_PREFIX + "ephemeral", "x"]),
        st.text(max_size=20),
        max_size=5,
    ),
)
def test_hostile_requests_are_refused_in_one_line(
    volume_id: str, target: str, context: dict[str, str]
) -> None:
    try:
        v = volume_from_request(volume_id, target, context, True)
    except InvalidArgument as e:
        assert "\n" not in str(e)
        return
    assert isinstance(v, Volume) and os.path.isabs(v.target) and v.dataset


# The plugin with a node and mountd: slow.


class Stack:
    """A node, mountd and the plugin, as the DaemonSet runs them, in `root`."""

    def __init__(
        self, root: Path, node_env: dict[str, str] | None = None, policy: Path | None = None
    ):
        self.root = root
        self.kubelet = root / "kubelet"
        self.policy = policy
        token = root / "token"
        auth.write_token(token, auth.new_admin_token())
        (root / "empty.toml").write_text("")
        base = {**os.environ, "KSPEEDFS_CONFIG": str(root / "empty.toml"), **(node_env or {})}
        self.shm = Path(f"/dev/shm/kspeedfs-test-{uuid.uuid4().hex[:10]}")
        self.node = NodeProcess(self.shm, token, root, base_env=base, segment_size="256KiB")
        self.node.start()
        self.env = self.node.env()
        self.run = root / "run"
        self.run.mkdir()
        self.mountd = MountdDaemon(self.run / "mounts.d", self.run / "mountd.json", self.env, root)
        self.mountd.start()
        self.plugin = self._plugin().start()
        self.client = CsiClient(self.plugin.socket)
        self.pods = self.kubelet / "pods"

    def _plugin(self, publish_timeout: float = 60.0) -> PluginDaemon:
        return PluginDaemon(
            self.run,
            self.env,
            publish_timeout=publish_timeout,
            kubelet_dir=self.kubelet,
            policy=self.policy,
        )

    def target(self, pod: str, volume: str = "data") -> Path:
        """kubelet's target path for a pod's CSI volume; kubelet makes its parent."""
        path = self.pods / pod / "volumes" / "kubernetes.io~csi" / volume / "mount"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def restart_plugin(self, publish_timeout: float = 60.0) -> None:
        self.client.close()
        self.plugin = self._plugin(publish_timeout).start()
        self.client = CsiClient(self.plugin.socket)

    def datasets(self) -> dict[str, dict[str, object]]:
        return {d["name"]: d for d in self.node.request("list")["datasets"]}

    def stop(self) -> None:
        self.client.close()
        self.plugin.stop()
        self.mountd.stop()  # unmounts what is still declared
        for path in self.pods.glob("*/volumes/*/*/mount"):
            if kspeedfs_mounted(path):
                lazy_unmount(path)
        self.node.stop()
        shutil.rmtree(self.shm, ignore_errors=True)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path)
    yield s
    s.stop()


def code_of(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as e:
        return e.code()  # type: ignore[no-any-return]
    raise AssertionError("the call succeeded")


@pytest.mark.slow
@pytest.mark.fuse
def test_kubelet_calls_in_order(stack: Stack, tmp_path: Path) -> None:
    src = tmp_path / "imagenet"
    make_sample(src, classes=3, per_class=6, file_size=6000, bases=3)
    preload(stack.node, src, "imagenet")
    c = stack.client

    assert c.call("Probe").ready.value is True
    info = c.call("GetPluginInfo")
    assert info.name == "csi.kspeedfs.io" and info.vendor_version
    assert c.call("NodeGetInfo").node_id == "node-a"
    caps = c.call("NodeGetCapabilities").capabilities
    assert [cap.rpc.type for cap in caps] == [pb.NodeServiceCapability.RPC.GET_VOLUME_STATS]
    assert list(c.call("GetPluginCapabilities").capabilities) == []

    target = stack.target("pod-1")
    context = inline_context("imagenet", pod="pod-1")
    c.publish("csi-0a1b", target, context)
    c.publish("csi-0a1b", target, context)  # kubelet retries: the same answer, one mount
    assert kspeedfs_mounted(target)
    assert len(re.findall(r"supervisor: csi-\w+: mounted imagenet at", stack.mountd.log())) == 1

    seen = json.loads(run_pod(IMAGEFOLDER, str(target)))
    assert seen == imagefolder_here(src)
    assert len(seen["samples"]) == 18
    # Read-only, even to root in the pod.
    with pytest.raises(RuntimeError, match="Read-only file system"):
        run_pod("import sys; open(sys.argv[1] + '/x', 'wb')", str(target))

    stats = c.call("NodeGetVolumeStats", volume_id="csi-0a1b", volume_path=str(target))
    assert {u.unit for u in stats.usage} == {pb.VolumeUsage.BYTES, pb.VolumeUsage.INODES}

    # Each bad call gets the spec's code, and changes nothing.
    bad = stack.target("pod-2")
    ok = inline_context("imagenet")
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: c.publish("", bad, ok)) == invalid
    assert code_of(lambda: c.publish("v", "", ok)) == invalid
    assert code_of(lambda: c.publish("v", bad, inline_context("Bad_Name"))) == invalid
    assert code_of(lambda: c.publish("v", bad, {**ok, "colour": "red"})) == invalid
    assert code_of(
        lambda: c.call("NodePublishVolume", volume_id="v", target_path=str(bad))
    ) == invalid  # fmt: skip
    assert code_of(lambda: c.publish("v", bad, inline_context("nosuch"))) == (
        grpc.StatusCode.NOT_FOUND
    )
    preload(stack.node, src, "other")
    assert code_of(lambda: c.publish("csi-0a1b", target, inline_context("other"))) == (
        grpc.StatusCode.ALREADY_EXISTS
    )
    assert code_of(lambda: c.publish("csi-ffff", target, context)) == (
        grpc.StatusCode.ALREADY_EXISTS
    )
    assert code_of(lambda: c.unpublish("", target)) == invalid
    assert code_of(lambda: c.unpublish("csi-0a1b", "")) == invalid
    assert code_of(lambda: c.unpublish("csi-ffff", target)) == grpc.StatusCode.NOT_FOUND
    assert code_of(
        lambda: c.call("NodeGetVolumeStats", volume_id="csi-0a1b", volume_path=str(bad))
    ) == grpc.StatusCode.NOT_FOUND  # fmt: skip
    assert code_of(
        lambda: c.call("NodeGetVolumeStats", volume_id="", volume_path=str(target))
    ) == invalid  # fmt: skip
    assert not bad.exists() and kspeedfs_mounted(target)
    # Bytes that are no NodePublishVolumeRequest: refused, and the plugin serves on.
    raw = c.channel.unary_unary("/csi.v1.Node/NodePublishVolume")
    for junk in (b"\xff\xff\xff", b"\x22\x05/tmp", os.urandom(64)):
        assert code_of(lambda junk=junk: raw(junk, timeout=30)) in (
            invalid,
            grpc.StatusCode.INTERNAL,
        )
    assert c.call("Probe").ready.value is True

    # A PV: its volumeHandle names the dataset, no pod details.
    pv_target = stack.target("pod-3", "pv")
    c.publish("other", pv_target, {})
    assert sorted(os.listdir(pv_target)) == sorted(os.listdir(src))
    c.unpublish("other", pv_target)

    c.unpublish("csi-0a1b", target)
    c.unpublish("csi-0a1b", target)
    assert not target.exists() and not kspeedfs_mounted(target)
    assert not list((stack.run / "mounts.d").glob("*.toml"))
    assert not list((stack.run / "state" / "volumes").glob("*.json"))


@pytest.fixture
def short_leases(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path, {"KSPEEDFS_LEASE_TTL": "2"})
    yield s
    s.stop()


@pytest.mark.slow
@pytest.mark.fuse
def test_warm_volumes(short_leases: Stack, tmp_path: Path) -> None:
    stack, c = short_leases, short_leases.client
    src = make_tree(tmp_path / "src")
    assert "warm" not in stack.datasets()

    a, b = stack.target("pod-a"), stack.target("pod-b")
    context = inline_context("warm", source=str(src))
    c.publish("vol-a", a, context)
    # Publish answered once the dataset was resident: ready, leased, this volume's lease.
    ds = stack.datasets()["warm"]
    assert (ds["state"], ds["lifetime"], ds["leases"]) == ("ready", "leased", 1)
    c.publish("vol-b", b, context)  # a second pod on the node: the same load, a lease more
    assert stack.datasets()["warm"]["leases"] == 2
    assert (a / "a" / "small.txt").read_bytes() == b"hello kspeedfs\n"
    assert (b / "big.bin").read_bytes() == (src / "big.bin").read_bytes()

    # The leases are renewed (ttl 2 s): the dataset stays for as long as its volumes.
    # under test: leases renewed over more than two ttls
    time.sleep(5)
    assert stack.datasets()["warm"]["leases"] == 2
    c.unpublish("vol-a", a)
    assert stack.datasets()["warm"]["leases"] == 1
    c.unpublish("vol-b", b)  # the last one: the node unloads it
    wait_for(lambda: "warm" not in stack.datasets(), what="warm unloaded with its last volume")

    # lifetime=persistent: loaded offline, kept after the last unpublish.
    p = stack.target("pod-p")
    c.publish("vol-p", p, inline_context("kept", source=str(src), lifetime="persistent"))
    assert stack.datasets()["kept"]["lifetime"] == "offline"
    c.unpublish("vol-p", p)
    # under test: a persistent dataset outlives its last volume
    time.sleep(3)
    assert stack.datasets()["kept"]["state"] == "ready"

    # A load longer than the publish timeout: one line, DEADLINE_EXCEEDED (kubelet calls
    # again), and the load goes on; the next publish finds it.
    stack.plugin.stop()
    stack.restart_plugin(publish_timeout=0.001)
    slow, big = stack.target("pod-s"), tmp_path / "big"
    big.mkdir()
    (big / "big.bin").write_bytes(os.urandom(48 << 20))  # far from ready in a millisecond
    with pytest.raises(grpc.RpcError) as caught:
        stack.client.publish("vol-s", slow, inline_context("late", source=str(big)))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "not resident yet" in caught.value.details() and "\n" not in caught.value.details()
    assert not kspeedfs_mounted(slow)
    stack.plugin.stop()
    stack.restart_plugin()
    stack.client.publish("vol-s", slow, inline_context("late", source=str(big)))
    assert (slow / "big.bin").read_bytes() == (big / "big.bin").read_bytes()


# The pod's stock ImageFolder on a decoded volume: with its own PIL loader, each decodable
# sample's pixels; with a bytes loader, every sample's bytes (as IMAGEFOLDER).
DECODED_POD = """
import hashlib, json, sys
import numpy as np
from torchvision.datasets import ImageFolder
root = sys.argv[1]
ds = ImageFolder(root, is_valid_file=lambda p: p.endswith(".ppm") and "corrupt" not in p)
pixels = [(p[len(root) + 1:], c, ds[i][0].size, hashlib.sha256(np.asarray(ds[i][0]).tobytes()).hexdigest())
          for i, (p, c) in enumerate(ds.samples)]
raw = ImageFolder(root, loader=lambda p: open(p, "rb").read())
out = [(p[len(root) + 1:], c, hashlib.sha256(raw[i][0]).hexdigest()) for i, (p, c) in enumerate(raw.samples)]
print(json.dumps({"pixels": pixels, "raw": {"classes": raw.classes, "samples": out}}))
"""


def imagefolder_in(root: Path) -> dict[str, object]:
    """What IMAGEFOLDER prints, computed in this process."""
    from torchvision.datasets import ImageFolder

    ds = ImageFolder(str(root), loader=lambda p: open(p, "rb").read())  # noqa: SIM115
    out = [
        [os.path.relpath(p, root), c, hashlib.sha256(ds[i][0]).hexdigest()]
        for i, (p, c) in enumerate(ds.samples)
    ]
    return {"classes": ds.classes, "samples": out}


def resized_here(src: Path, size: int) -> list[list[object]]:
    """DECODED_POD's pixels for the decoded variant of `src`, computed from the source."""
    from torchvision import transforms
    from torchvision.datasets import ImageFolder
    from torchvision.datasets.folder import pil_loader

    valid = lambda p: p.lower().endswith((".jpg", ".jpeg", ".png")) and "corrupt" not in p  # noqa: E731
    ref = ImageFolder(str(src), is_valid_file=valid)
    out: list[list[object]] = []
    for path, c in ref.samples:
        img = transforms.Resize(size)(pil_loader(path))
        rel = os.path.relpath(path, src).rsplit(".", 1)[0] + ".ppm"  # no shared stems here
        digest = hashlib.sha256(img.tobytes()).hexdigest()  # RGB: np.asarray(img).tobytes()
        out.append([rel, c, list(img.size), digest])
    return out


@pytest.mark.slow
@pytest.mark.fuse
def test_decoded_volume(stack: Stack, tmp_path: Path) -> None:
    """An inline volume with decoded=64 and an uncached source: publish preloads the dataset,
    the mount starts its decoded variant (the node had none), and the pod's stock ImageFolder
    reads Resize(64) of each image; the bytes are those the all-datasets mount shows under
    imgs@64/. A decoded=0 volume of the same dataset shows the files as they are."""
    src = tmp_path / "images"
    make_images(src)
    c = stack.client
    target, plain = stack.target("pod-d"), stack.target("pod-p")
    c.publish("vol-d", target, inline_context("imgs", source=str(src), decoded="64"))
    assert "64" in stack.node.request("decode_status", name="imgs")["variants"]
    decl = next((stack.run / "mounts.d").glob("*.toml")).read_text()
    assert 'dataset = "imgs@64"' in decl
    seen = json.loads(run_pod(DECODED_POD, str(target)))
    assert seen["pixels"] == resized_here(src, 64)
    c.publish("vol-d", target, inline_context("imgs", source=str(src), decoded="64"))  # again
    assert code_of(
        lambda: c.publish("vol-d", target, inline_context("imgs", source=str(src)))
    ) == grpc.StatusCode.ALREADY_EXISTS  # fmt: skip
    c.publish("vol-p", plain, inline_context("imgs", source=str(src), decoded="0"))
    assert imagefolder_in(plain) == imagefolder_in(src)
    every = MountProcess(tmp_path / "every", stack.env, tmp_path).start()
    try:
        wait_for(lambda: (every.mountpoint / "imgs@64").exists(), what="imgs@64 on the mount")
        beside = imagefolder_in(every.mountpoint / "imgs@64")
        assert seen["raw"] == beside
        assert len(beside["samples"]) == 8  # type: ignore[arg-type]
    finally:
        every.stop()
    c.unpublish("vol-d", target)
    c.unpublish("vol-p", plain)
    assert not target.exists() and not plain.exists()
    wait_for(lambda: "imgs" not in stack.datasets(), what="imgs unloaded with its last volume")


READER = """
import errno, json, os, sys, time
root, src, until = sys.argv[1], sys.argv[2], float(sys.argv[3])
names = sorted(n for n in os.listdir(os.path.join(src, "a")) if os.path.isfile(os.path.join(src, "a", n)))
reads = wrong = 0
errors = []
stamps = []
while time.time() < until:
    for name in names:
        try:
            with open(os.path.join(root, "a", name), "rb") as f:
                got = f.read()
                # Out of the page cache: the mount's processes answer the next round.
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            errors.append(errno.errorcode.get(e.errno, str(e.errno)))
            continue
        with open(os.path.join(src, "a", name), "rb") as f:
            want = f.read()
        wrong += sum(x != y for x, y in zip(got, want)) + abs(len(got) - len(want))
        reads += 1
        stamps.append(time.time())
gaps = [b - a for a, b in zip(stamps, stamps[1:])]
print(json.dumps({"reads": reads, "wrong": wrong, "errors": errors, "stamps": stamps,
                  "max_gap": max(gaps or [0])}))
"""


@pytest.fixture
def six_s_leases(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path, {"KSPEEDFS_LEASE_TTL": "6"})
    yield s
    s.stop()


@pytest.mark.slow
@pytest.mark.fuse
def test_plugin_killed_while_a_pod_reads(six_s_leases: Stack, tmp_path: Path) -> None:
    """mountd holds the mounts, so the pod's reads go on; the plugin started again takes its
    volumes back from its records: their leases (6 s ttl: the plugin is away ~3 s) and
    their unpublish."""
    stack, c = six_s_leases, six_s_leases.client
    src = make_tree(tmp_path / "src")
    target = stack.target("pod-r")
    c.publish("vol-r", target, inline_context("live", source=str(src)))
    mounts = json.loads(stack.mountd.state_file.read_text())["mounts"]
    assert [m["state"] for m in mounts] == ["mounted"]

    until = time.time() + 9
    reader = subprocess.Popen(
        pod_command([sys.executable, "-c", READER, str(target), str(src), str(until)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    # under test: the pod has read for a while before the kill
    time.sleep(2)
    killed_at = time.time()
    stack.plugin.kill9()
    # under test: the plugin stays down for a second
    time.sleep(1)
    stack.restart_plugin()
    restarted_at = time.time()
    c = stack.client
    out, _ = reader.communicate(timeout=60)
    result = json.loads(out)
    assert result["errors"] == [], result["errors"]  # no ENOTCONN, no EIO
    assert result["wrong"] == 0
    # Reads went on while the plugin was dead.
    assert any(killed_at < t < restarted_at for t in result["stamps"])
    print(f"reads {result['reads']}, longest gap between reads {result['max_gap']:.3f}s")

    # The new plugin adopted the volume: its lease (renewed past a ttl), its unpublish.
    # under test: the adopted lease is renewed past a ttl
    time.sleep(7)
    assert stack.datasets()["live"]["leases"] == 1
    assert c.call("Probe").ready.value is True
    c.unpublish("vol-r", target)
    assert not target.exists()
    wait_for(lambda: "live" not in stack.datasets(), what="live unloaded with its volume")


@pytest.mark.slow
def test_plugin_without_mountd_or_node(tmp_path: Path) -> None:
    """Nothing to mount with: Probe says not ready, a publish is UNAVAILABLE in one line and
    leaves nothing behind, an unpublish of what was never published answers OK."""
    (tmp_path / "empty.toml").write_text("")
    auth.write_token(tmp_path / "token", auth.new_admin_token())
    env = {
        **os.environ,
        "KSPEEDFS_CONFIG": str(tmp_path / "empty.toml"),
        "KSPEEDFS_TOKEN_FILE": str(tmp_path / "token"),
        "KSPEEDFS_NODES": "127.0.0.1:9",  # nobody listens on the discard port
        "KSPEEDFS_TIMEOUT": "2",
    }
    run = tmp_path / "run"
    run.mkdir()
    plugin = PluginDaemon(run, env).start()
    client = CsiClient(plugin.socket, timeout=30)
    try:
        assert client.call("Probe").ready.value is False
        target = tmp_path / "pod" / "mount"
        target.parent.mkdir()
        with pytest.raises(grpc.RpcError) as caught:
            client.publish("v", target, inline_context("imagenet"))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "\n" not in caught.value.details()
        assert not target.exists() and not list((run / "state" / "volumes").iterdir())
        client.unpublish("v", target)
        client.unpublish("v", target)
    finally:
        client.close()
        plugin.stop()


# The admin's volume policy, the kubelet folder, records of gone pods, listening first.


def refused(call: object, code: grpc.StatusCode, why: str) -> None:
    """`call` fails with `code` and a one-line message that says `why`."""
    with pytest.raises(grpc.RpcError) as caught:
        call()  # type: ignore[operator]
    assert caught.value.code() == code, caught.value.details()
    assert why in caught.value.details() and "\n" not in caught.value.details()


POLICY = """
[[allow]]
namespaces = ["team-a"]
datasets = ["vision-*"]
sources = ["{allowed}"]
load = true
pin = false

[[allow]]
namespaces = ["team-b", "team-b-*"]
datasets = ["vision-shared"]
sources = ["{allowed}"]
load = false
"""


@pytest.mark.slow
@pytest.mark.fuse
def test_volume_policy(tmp_path: Path) -> None:
    """A namespace uses only what the policy names: a namespace not allowed, a dataset not
    named, a source outside its prefixes (`..` included), a pin where pinning is not allowed,
    a load where loading is not: PERMISSION_DENIED in one line, nothing loaded, nothing
    mounted, nothing recorded. What it allows works, and an edit applies at the next publish."""
    allowed, elsewhere = tmp_path / "allowed", tmp_path / "elsewhere"
    src = make_tree(allowed / "vision")
    make_tree(elsewhere / "vision")
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY.format(allowed=allowed))
    stack = Stack(tmp_path / "stack", policy=policy)
    try:
        c, denied = stack.client, grpc.StatusCode.PERMISSION_DENIED
        target = stack.target("pod-x")

        def publish(namespace: str, dataset: str, **attrs: str) -> object:
            context = inline_context(dataset, namespace=namespace, **attrs)
            return lambda: c.publish("vol-x", target, context)

        here = str(src)
        refused(publish("team-c", "vision-a", source=here), denied, "namespace team-c may not")
        refused(publish("team-a", "text-a", source=here), denied, "may not use dataset text-a")
        outside = str(elsewhere / "vision")
        refused(publish("team-a", "vision-a", source=outside), denied, "not under its sources")
        climbing = f"{allowed}/../elsewhere/vision"
        refused(publish("team-a", "vision-a", source=climbing), denied, "not under its sources")
        refused(
            publish("team-a", "vision-a", source=here, lifetime="persistent"), denied, "may not pin"
        )
        refused(publish("team-b", "vision-shared", source=here), denied, "does not let")
        no_namespace = {"dataset": "vision-a", "source": here}
        refused(lambda: c.publish("vol-x", target, no_namespace), denied, "podInfoOnMount")
        assert stack.datasets() == {}
        assert not kspeedfs_mounted(target)
        assert not list((stack.run / "state" / "volumes").glob("*.json"))
        assert not list((stack.run / "mounts.d").glob("*.toml"))

        # Allowed: team-a loads from its prefix; team-b reads what is cached.
        publish("team-a", "vision-a", source=here)()
        assert (target / "a" / "small.txt").read_bytes() == b"hello kspeedfs\n"
        preload(stack.node, src, "vision-shared")
        other = stack.target("pod-y")
        c.publish("vol-y", other, inline_context("vision-shared", namespace="team-b-7"))
        assert (other / "big.bin").read_bytes() == (src / "big.bin").read_bytes()

        # An edit applies at the next publish; a policy that cannot be read refuses all.
        policy.write_text(POLICY.format(allowed=allowed).replace('"team-b", ', ""))
        third = stack.target("pod-z")
        again = inline_context("vision-shared", namespace="team-b")
        refused(lambda: c.publish("vol-z", third, again), denied, "namespace team-b may not")
        policy.write_text("[[allow]]\nnamespaces = 'team-b'\n")
        refused(lambda: c.publish("vol-z", third, again), denied, "must be a list")
        policy.unlink()
        refused(lambda: c.publish("vol-z", third, again), denied, "cannot be read")
        assert not kspeedfs_mounted(third)
        # What was published stays published, and unpublishes.
        c.unpublish("vol-x", target)
        c.unpublish("vol-y", other)
        wait_for(lambda: "vision-a" not in stack.datasets(), what="vision-a unloaded")
    finally:
        stack.stop()


@pytest.mark.slow
@pytest.mark.fuse
def test_targets_outside_the_kubelet_dir_are_refused(stack: Stack) -> None:
    """The plugin publishes only under its --kubelet-dir (the manifests' kubeletDir)."""
    outside = stack.root / "elsewhere" / "mount"
    outside.parent.mkdir()
    refused(
        lambda: stack.client.publish("v", outside, inline_context("any")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "is not under kubelet's folder",
    )
    assert not outside.exists()


@pytest.mark.slow
@pytest.mark.fuse
def test_records_of_gone_pods_are_dropped(stack: Stack, tmp_path: Path) -> None:
    """After a reboot (mountd's run folder gone, kubelet's pod folders cleaned), a record whose
    pod folder is gone is dropped at start, with its lease (released: the default ttl is far
    longer than the test): nothing is mounted for it and its dataset is unloaded. A record
    whose pod is there is declared and mounted again, its lease kept."""
    c = stack.client
    src = make_tree(tmp_path / "src")
    gone, kept = stack.target("pod-gone"), stack.target("pod-kept")
    c.publish("vol-gone", gone, inline_context("gone", source=str(src)))
    c.publish("vol-kept", kept, inline_context("kept", source=str(src)))
    stack.plugin.stop()
    stack.mountd.stop()  # unmounts both
    for path in (stack.run / "mounts.d").glob("*.toml"):
        path.unlink()  # the pod's emptyDir: gone with the reboot
    stack.mountd.state_file.unlink(missing_ok=True)  # mountd removes it as it stops
    shutil.rmtree(stack.pods / "pod-gone")
    stack.mountd = MountdDaemon(
        stack.run / "mounts.d", stack.mountd.state_file, stack.env, stack.root
    ).start()
    stack.restart_plugin()
    records = [json.loads(p.read_text()) for p in (stack.run / "state" / "volumes").iterdir()]
    assert [r["volume_id"] for r in records] == ["vol-kept"]
    wait_for(lambda: kspeedfs_mounted(kept), what="the kept volume mounted again")
    wait_for(lambda: "gone" not in stack.datasets(), what="the gone volume's lease released")
    assert not (stack.pods / "pod-gone").exists()
    assert stack.datasets()["kept"]["leases"] == 1
    c = stack.client
    c.unpublish("vol-kept", kept)


@pytest.mark.slow
def test_the_plugin_listens_before_it_renews(tmp_path: Path) -> None:
    """A lease whose node hangs (accepts, never answers) does not keep the plugin from
    listening: it serves kubelet while that renewal waits."""
    import socket

    hung = socket.create_server(("127.0.0.1", 0))
    (tmp_path / "empty.toml").write_text("")
    auth.write_token(tmp_path / "token", auth.new_admin_token())
    env = {
        **os.environ,
        "KSPEEDFS_CONFIG": str(tmp_path / "empty.toml"),
        "KSPEEDFS_TOKEN_FILE": str(tmp_path / "token"),
        "KSPEEDFS_NODES": f"127.0.0.1:{hung.getsockname()[1]}",
        "KSPEEDFS_TIMEOUT": "600",
    }
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "kubelet" / "pods" / "p" / "mount"
    target.parent.mkdir(parents=True)
    volume = Volume(
        volume_id="v",
        target=str(target),
        dataset="d",
        lease="l-1",
        lease_home=f"127.0.0.1:{hung.getsockname()[1]}",
    )
    VolumeRecords(run / "state" / "volumes").put(volume)
    plugin = PluginDaemon(run, env).start()
    client = CsiClient(plugin.socket, timeout=30)
    try:
        hung.settimeout(60)
        conn, _ = hung.accept()  # the renewal has begun, and waits on this connection
        assert client.call("GetPluginInfo").name == "csi.kspeedfs.io"
        assert client.call("NodeGetInfo").node_id == "node-a"
        conn.close()
    finally:
        client.close()
        plugin.stop()
        hung.close()


# Real containers: podman with runc, the volume bound as the container runtime binds it.

# Every file under /data with its sha256, and whether a write fails, from a busybox root.
CONTAINER_READ = (
    'cd /data && find . -type f | sort | while read -r f; do sha256sum "$f"; done; '
    "touch /data/x 2>/dev/null && echo WRITABLE; grep ' /data ' /proc/self/mountinfo"
)


def require_container_tools() -> None:
    for tool in ("podman", "runc", BUSYBOX):
        if shutil.which(tool) is None:
            pytest.skip(
                f"{tool} is not installed (make test installs podman, runc, busybox-static)"
            )


def publish_sample(
    stack: Stack, tmp_path: Path, suffix: str, classes: int, per_class: int
) -> tuple[Path, Path]:
    """An ImageFolder-shaped source published as volume vol-SUFFIX of pod-SUFFIX: (the
    source, the target)."""
    src = tmp_path / "imagenet"
    make_sample(src, classes=classes, per_class=per_class, file_size=6000, bases=classes)
    target = stack.target(f"pod-{suffix}")
    stack.client.publish(f"vol-{suffix}", target, inline_context("imagenet", source=str(src)))
    return src, target


@pytest.fixture
def shared_kubelet(stack: Stack) -> Iterator[Stack]:
    """The stack with its kubelet folder a shared mount of its own, as kubelet makes its root
    (`rshared`), so that a container's `rslave` bind of a target is a slave of the host's."""
    stack.kubelet.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(stack.kubelet), str(stack.kubelet)], check=True)
    subprocess.run(["mount", "--make-rshared", str(stack.kubelet)], check=True)
    yield stack
    for path in stack.pods.glob("*/volumes/*/*/mount"):
        if kspeedfs_mounted(path):
            lazy_unmount(path)
    subprocess.run(["umount", "-l", str(stack.kubelet)], check=False)


@pytest.mark.slow
@pytest.mark.fuse
def test_a_container_reads_a_published_volume(shared_kubelet: Stack, tmp_path: Path) -> None:
    """A real OCI container (podman, runc, a static busybox root) with the published target
    bound `ro,rslave` at /data reads every file of the source byte-equal (sha256 of each,
    computed in the container), cannot write, and sees the kspeedfs mount as a slave of the
    host's."""
    require_container_tools()
    c = shared_kubelet.client
    src, target = publish_sample(shared_kubelet, tmp_path, "c", classes=3, per_class=6)
    root = busybox_root(tmp_path / "rootfs")
    done = subprocess.run(
        container_command(root, {target: "/data"}, ["/bin/sh", "-c", CONTAINER_READ]),
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    lines = done.stdout.decode(errors="replace").splitlines()
    mountinfo = [line for line in lines if " /data " in line]
    sums = [line.split("  ./", 1) for line in lines if "  ./" in line]
    want = {
        str(p.relative_to(src)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in src.rglob("*")
        if p.is_file()
    }
    assert {path: digest for digest, path in sums} == want
    assert len(want) == 18
    assert "WRITABLE" not in lines
    (line,) = mountinfo
    assert "fuse.kspeedfs" in line and "master:" in line, line
    c.unpublish("vol-c", target)


def mount_pid(stack: Stack) -> int | None:
    (mount,) = json.loads(stack.mountd.state_file.read_text())["mounts"]
    return mount["pid"] if mount["state"] == "mounted" else None


@pytest.mark.slow
@pytest.mark.fuse
def test_a_container_reads_on_while_its_mount_process_is_killed(
    shared_kubelet: Stack, tmp_path: Path
) -> None:
    """A real container (the target bound `ro,rslave`) reads every file in a loop, each read
    reaching the mount process (the host drops the pages meanwhile); the volume's mount process
    is SIGKILLed (as an OOM kill would). mountd keeps the FUSE connection and a new process
    takes it over: no read in the container fails (ENOTCONN or other), every byte is right,
    and the container reads on after the takeover."""
    require_container_tools()
    stack, c = shared_kubelet, shared_kubelet.client
    src, target = publish_sample(stack, tmp_path, "k", classes=2, per_class=4)
    files = {str(p.relative_to(src)): p.read_bytes() for p in src.rglob("*") if p.is_file()}
    root = busybox_root(tmp_path / "rootfs")
    loop = container_loop(sorted(files), seconds=40)
    reader = ContainerReader(container_command(root, {target: "/data"}, loop), files, target)
    reader.start()
    try:
        assert reader.first_read(120), "the container never read"
        pid = mount_pid(stack)
        assert pid is not None
        wait_for(lambda: reader.reads.good >= 20, what="the container reads")
        os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda: "mount process serves" in stack.mountd.log(), timeout=60, what="taken over"
        )
        good = reader.reads.good
        wait_for(lambda: reader.reads.good >= good + 20, timeout=60, what="reads after it")
    finally:
        reads = reader.wait(120)
    print(reads.line("container reader, mount process killed"))
    assert reads.failed == []
    c.unpublish("vol-k", target)
