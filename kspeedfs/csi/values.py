"""The values of an install (`kspeedfs kubernetes manifests` flags, or `--values FILE`), checked
once: what a platform team sets (image, registries, paths, placement, resources, priority)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kspeedfs.format.errors import InvalidArgument

REGISTRAR_IMAGE = "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.13.0"
LIVENESSPROBE_IMAGE = "registry.k8s.io/sig-storage/livenessprobe:v2.15.0"
CONTAINERS = ("node", "mountd", "csi-plugin", "node-driver-registrar", "liveness-probe")
# Requests only: the pod is Burstable and the scheduler sees what it holds. No memory limit on
# any container: the node's is its cache (tmpfs pages charged to it; a limit would OOM-kill it
# as the cache fills), mountd's are the mount processes (a kill is ENOTCONN in every pod).
DEFAULT_REQUESTS = {
    "node": {"cpu": "500m"},  # memory: the cache budget (cacheMemory), set below
    "mountd": {"cpu": "200m", "memory": "256Mi"},
    "csi-plugin": {"cpu": "50m", "memory": "128Mi"},
    "node-driver-registrar": {"cpu": "10m", "memory": "32Mi"},
    "liveness-probe": {"cpu": "10m", "memory": "32Mi"},
}
# A Kubernetes quantity of memory: 64Gi, 512Mi, 1G, 1073741824.
_QUANTITY_RE = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|K|M|G|T|P|E)?$")
_QUANTITY_FACTORS = {
    **{s: 1024 ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: 1000 ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
    "K": 1000,
    "": 1,
}
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # an RFC 1123 label
_DOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclasses.dataclass(frozen=True)
class Values:
    """One install's values; every field has its `--values` key in KEYS."""

    image: str
    namespace: str = "kspeedfs"
    registrar_image: str = REGISTRAR_IMAGE
    livenessprobe_image: str = LIVENESSPROBE_IMAGE
    image_pull_secrets: tuple[str, ...] = ()
    kubelet_dir: str = "/var/lib/kubelet"
    data_dir: str = "/data"
    node_selector: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: {"kubernetes.io/os": "linux"}
    )
    # Every taint tolerated: a GPU machine's taints must not keep its cache away.
    tolerations: tuple[Mapping[str, Any], ...] = ({"operator": "Exists"},)
    cache_memory: str = "8Gi"  # the node's memory request, and so its cache budget
    resources: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    priority_class: str = "system-node-critical"
    metrics_port: int = 9420  # the node's /metrics (0: off)
    # The liveness-probe sidecar's /healthz (the plugin's Probe), on the host's loopback: not
    # 9808, the sidecar's default, which other drivers on the host network take.
    health_port: int = 9825
    port: int = 7420
    cluster_domain: str = "cluster.local"

    def __post_init__(self) -> None:
        check(self)

    @property
    def plugin_dir(self) -> str:
        """Where kubelet finds the plugin's socket (the registrar tells it this path)."""
        from .volumes import DRIVER_NAME

        return f"{self.kubelet_dir}/plugins/{DRIVER_NAME}"

    @property
    def cache_bytes(self) -> int:
        return quantity_bytes(self.cache_memory)

    def resources_for(self, container: str) -> dict[str, Any]:
        """The container's resources: the defaults, then `resources` of the values."""
        base: dict[str, Any] = {"requests": dict(DEFAULT_REQUESTS[container])}
        if container == "node":
            base["requests"]["memory"] = self.cache_memory
        given = self.resources.get(container, {})
        for key in ("requests", "limits"):
            if key in given:
                base[key] = {**base.get(key, {}), **given[key]}
        return base


# The `--values` file's keys (as a chart's values: camelCase) and the fields they set.
KEYS = {
    "image": "image",
    "namespace": "namespace",
    "registrarImage": "registrar_image",
    "livenessProbeImage": "livenessprobe_image",
    "imagePullSecrets": "image_pull_secrets",
    "kubeletDir": "kubelet_dir",
    "dataDir": "data_dir",
    "nodeSelector": "node_selector",
    "tolerations": "tolerations",
    "cacheMemory": "cache_memory",
    "resources": "resources",
    "priorityClassName": "priority_class",
    "metricsPort": "metrics_port",
    "healthPort": "health_port",
    "port": "port",
    "clusterDomain": "cluster_domain",
}


def quantity_bytes(text: str) -> int:
    """A Kubernetes memory quantity in bytes; InvalidArgument in one line."""
    m = _QUANTITY_RE.match(str(text))
    if not m:
        raise InvalidArgument(f"not a memory quantity: {text!r} (examples: 64Gi, 512Mi)")
    return int(float(m.group(1)) * _QUANTITY_FACTORS[m.group(2) or ""])


def split_image(image: str) -> tuple[str, str]:
    """(repository, tag) of an image reference; tag "" where there is none to split off: no
    tag (`host:5000/repo`: the port is no tag) or a digest (kept whole in the repository)."""
    last = image.rsplit("/", 1)[-1]
    if "@" in image or ":" not in last:
        return image, ""
    repo, tag = image.rsplit(":", 1)
    return repo, tag


def _absolute(key: str, path: str) -> None:
    if not path.startswith("/") or "\x00" in path or path != path.rstrip("/") or "//" in path:
        raise InvalidArgument(f"{key} must be an absolute path without a trailing /: {path!r}")


def check(v: Values) -> None:
    """Each value against its rule; the first one wrong, in one line."""
    if not v.image or any(c.isspace() for c in v.image):
        raise InvalidArgument(
            "--image is required: the kspeedfs image your machines pull (built from the "
            "Containerfile, docs/kubernetes.md)"
        )
    if not _NAME_RE.match(v.namespace):
        raise InvalidArgument(f"namespace must be a DNS label: {v.namespace!r}")
    for secret in v.image_pull_secrets:
        if not _DOMAIN_RE.match(secret) or len(secret) > 253:
            raise InvalidArgument(f"imagePullSecrets: not a Secret name: {secret!r}")
    _absolute("kubeletDir", v.kubelet_dir)
    _absolute("dataDir", v.data_dir)
    if not _DOMAIN_RE.match(v.priority_class) or len(v.priority_class) > 253:
        raise InvalidArgument(f"priorityClassName: not a PriorityClass name: {v.priority_class!r}")
    if not _DOMAIN_RE.match(v.cluster_domain):
        raise InvalidArgument(f"clusterDomain must be a DNS name: {v.cluster_domain!r}")
    if quantity_bytes(v.cache_memory) < 64 << 20:
        raise InvalidArgument(f"cacheMemory must be at least 64Mi: {v.cache_memory!r}")
    ports = {"port": v.port, "metricsPort": v.metrics_port, "healthPort": v.health_port}
    for port_key, port in ports.items():
        off = port == 0 and port_key == "metricsPort"
        if not isinstance(port, int) or not (0 < port < 65536 or off):
            raise InvalidArgument(f"{port_key} must be a port number: {port!r}")
    used = [p for p in ports.values() if p]
    if len(set(used)) != len(used):
        raise InvalidArgument(f"port, metricsPort and healthPort must differ: {ports}")
    unknown = sorted(set(v.resources) - set(CONTAINERS))
    if unknown:
        raise InvalidArgument(
            f"resources: no container {unknown[0]!r} (containers: {', '.join(CONTAINERS)})"
        )
    node_memory = v.resources.get("node", {}).get("requests", {}).get("memory")
    if node_memory is not None and quantity_bytes(node_memory) != v.cache_bytes:
        raise InvalidArgument(
            f"resources.node.requests.memory ({node_memory}) is not cacheMemory "
            f"({v.cache_memory}): the node's memory request is its cache budget; set cacheMemory"
        )
    node_limit = v.resources.get("node", {}).get("limits", {}).get("memory")
    if node_limit is not None and quantity_bytes(node_limit) < v.cache_bytes + (1 << 30):
        raise InvalidArgument(
            f"resources.node.limits.memory ({node_limit}) leaves under 1Gi above cacheMemory "
            f"({v.cache_memory}): the cache's shm pages count against it (OOM kill)"
        )
    for t in v.tolerations:
        if not isinstance(t, Mapping):
            raise InvalidArgument(f"tolerations: each is a mapping, not {t!r}")
    if not all(isinstance(k, str) and isinstance(x, str) for k, x in v.node_selector.items()):
        raise InvalidArgument("nodeSelector: labels and values are strings")


def load_values(path: Path | None, overrides: Mapping[str, Any]) -> Values:
    """Values from a YAML file (KEYS), then the `overrides` (fields set by flags, None: not
    given). One line for a file that cannot be read, an unknown key, or a bad value."""
    fields: dict[str, Any] = {}
    if path is not None:
        import yaml

        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise InvalidArgument(f"--values {path}: {' '.join(str(e).split())}") from None
        if not isinstance(data, dict):
            raise InvalidArgument(
                f"--values {path}: a mapping of values, not {type(data).__name__}"
            )
        for key, value in data.items():
            if key not in KEYS:
                raise InvalidArgument(
                    f"--values {path}: unknown key {key!r} (known: {', '.join(KEYS)})"
                )
            fields[KEYS[key]] = value
    fields.update({k: v for k, v in overrides.items() if v is not None})
    fields.setdefault("image", "")  # required: check() says so in one line
    for name in ("image_pull_secrets", "tolerations"):
        if name in fields:
            fields[name] = tuple(fields[name])
    try:
        return Values(**fields)
    except TypeError as e:  # a mapping where a string belongs, and the like
        raise InvalidArgument(f"bad values: {e}") from None
