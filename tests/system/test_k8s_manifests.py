"""`kspeedfs kubernetes manifests`: every object validates against the Kubernetes schemas of
1.29 through 1.37 with unknown fields refused, and what the containers run is a command line and
a settings file that kspeedfs itself accepts."""

from __future__ import annotations

import subprocess
import tomllib
from typing import Any

import pytest
from conftest import KSPEEDFS

from kspeedfs.cli.parser import build_parser
from kspeedfs.csi.manifests import DRIVER_NAME, render
from kspeedfs.format.setting_rules import RULES
from mountd.daemon import build_parser as mountd_parser

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

VERSIONS = [f"1.{minor}.0" for minor in range(29, 38)]


def documents(**kw: Any) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render(namespace="ml-cache", **kw)) if d]


def test_kubernetes_validate_ships_every_version() -> None:
    """The versions checked here are the ones the package has schemas of (not an older one
    standing in for a newer)."""
    from kubernetes_validate.utils import all_versions, major_minor

    shipped = {major_minor(v) for v in all_versions()}
    assert {major_minor(v) for v in VERSIONS} <= shipped


@pytest.mark.parametrize("version", VERSIONS)
def test_every_document_validates_strictly(version: str) -> None:
    docs = documents(with_examples=True)
    kinds = [d["kind"] for d in docs]
    assert kinds == [
        "Namespace",
        "CSIDriver",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "Service",
        "DaemonSet",
        "Pod",
        "PersistentVolume",
        "PersistentVolumeClaim",
        "Job",
    ]
    for doc in docs:
        got = kubernetes_validate.validate(doc, version, strict=True)
        assert got == version.rsplit(".", 1)[0]


def test_strict_validation_can_fail() -> None:
    """A field Kubernetes does not know is refused: the check above can catch a mistake."""
    daemonset = next(d for d in documents() if d["kind"] == "DaemonSet")
    daemonset["spec"]["template"]["spec"]["containers"][0]["mountPropagaton"] = "Bidirectional"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, "1.37.0", strict=True)


def test_what_the_manifests_say() -> None:
    docs = {d["kind"]: d for d in documents()}
    driver = docs["CSIDriver"]
    assert driver["metadata"]["name"] == DRIVER_NAME
    assert driver["spec"]["attachRequired"] is False
    assert driver["spec"]["podInfoOnMount"] is True
    assert driver["spec"]["volumeLifecycleModes"] == ["Persistent", "Ephemeral"]
    service = docs["Service"]["spec"]
    assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True

    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["shareProcessNamespace"] is True
    containers = {c["name"]: c for c in pod["containers"]}
    assert set(containers) == {"node", "mountd", "csi-plugin", "node-driver-registrar"}
    mounts = {c: {m["name"]: m for m in containers[c]["volumeMounts"]} for c in containers}
    assert mounts["mountd"]["kubelet"]["mountPropagation"] == "Bidirectional"
    assert mounts["csi-plugin"]["kubelet"]["mountPropagation"] == "HostToContainer"
    assert mounts["node"]["shm"]["mountPath"] == "/dev/shm"
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths["shm"] == "/dev/shm"
    for name in ("node", "mountd", "csi-plugin"):
        env = {e["name"]: e for e in containers[name]["env"]}
        assert {"NODE_NAME", "POD_IP", "HOST_IP", "KSPEEDFS_CONFIG"} <= set(env)
        # The node listens there, and the mounts know it as this machine's node.
        assert env["KSPEEDFS_LISTEN"]["value"] == "$(POD_IP):7420"

    # What the containers run is what kspeedfs and mountd accept.
    for name in ("node", "csi-plugin"):
        command = containers[name]["command"]
        assert command[0] == "kspeedfs"
        build_parser().parse_args(command[1:])
    mountd_parser().parse_args(containers["mountd"]["command"][1:])
    plugin = containers["csi-plugin"]["command"]
    registrar = containers["node-driver-registrar"]["args"]
    assert plugin[plugin.index("--endpoint") + 1] == "unix:///csi/csi.sock"
    assert f"--kubelet-registration-path=/var/lib/kubelet/plugins/{DRIVER_NAME}/csi.sock" in (
        registrar
    )
    # The plugin declares volumes where mountd reads them.
    mountd_cmd = containers["mountd"]["command"]
    assert (
        plugin[plugin.index("--mounts-dir") + 1] == mountd_cmd[mountd_cmd.index("--mounts-dir") + 1]
    )
    assert (
        plugin[plugin.index("--mountd-state") + 1]
        == (mountd_cmd[mountd_cmd.index("--state-file") + 1])
    )

    # The settings file: known settings, each accepted by its rule (DNS is not resolved here).
    settings = tomllib.loads(docs["ConfigMap"]["data"]["kspeedfs.toml"])
    assert settings["nodes"] == ["dns:kspeedfs-nodes.ml-cache.svc.cluster.local:7420"]
    for key, value in settings.items():
        assert key in RULES
        if key != "nodes":
            RULES[key](value)


def test_fluid_profile() -> None:
    """Fluid's kinds are CRDs (no schema in kubernetes-validate): their shape only."""
    docs = documents(fluid=True)
    assert [d["kind"] for d in docs] == ["ThinRuntimeProfile", "Dataset", "ThinRuntime"]
    profile = docs[0]
    assert profile["spec"]["fileSystemType"] == "fuse.kspeedfs"
    script = profile["spec"]["fuse"]["command"][2]
    compile(script, "fluid-mount", "exec")
    assert docs[2]["spec"]["profileName"] == profile["metadata"]["name"]


def test_the_command_prints_them() -> None:
    done = subprocess.run(
        [*KSPEEDFS, "kubernetes", "manifests", "--namespace", "ml-cache", "--image", "reg/ks:1"],
        capture_output=True,
        text=True,
        check=True,
    )
    docs = list(yaml.safe_load_all(done.stdout))
    assert docs == documents(image="reg/ks:1")
