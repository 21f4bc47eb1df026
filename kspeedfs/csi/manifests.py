"""`kspeedfs kubernetes manifests`: what installs kspeedfs on a cluster, as Kubernetes objects
(one YAML stream, or a Kustomize base), made from the install's values (values.py).

One DaemonSet pod per machine (system-node-critical, a request on every container, no memory
limit) runs five containers that share one process namespace:
- `node`: `kspeedfs node` on the host network (port 7420), its segments in the host's /dev/shm
  (they outlive the container, and jobs on the machine map them; charged to this container,
  so its memory request is the cache budget), its peers named by the headless Service's DNS
  name (`nodes = ["dns:..."]` in the ConfigMap), /metrics on a named port;
- `mountd`: `kspeedfs-mountd`, the owner of every volume's FUSE mount, with the kubelet folder
  shared both ways (mountPropagation Bidirectional), so a mount it makes reaches the host and
  kubelet's bind into the pod;
- `csi-plugin`: `kspeedfs csi`, which declares the volumes to mountd under the admin's volume
  policy (policy.toml in the ConfigMap); it can be killed or restarted without touching a
  mount (docs/kubernetes.md, "Upgrade");
- `node-driver-registrar`: registers the plugin's socket with kubelet (and probes it);
- `liveness-probe`: calls the plugin's Probe, for the plugin's liveness probe.

Every object here validates against the Kubernetes schemas of 1.29 through 1.37 with unknown
fields refused, and the Kustomize base renders with `kubectl kustomize`
(tests/system/test_k8s_manifests.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .policy import default_policy
from .values import Values
from .volumes import DRIVER_NAME

DEFAULT_NAMESPACE = "kspeedfs"
SERVICE = "kspeedfs-nodes"
RUN_DIR = "/run/kspeedfs-csi"  # mountd's declarations and status, shared with the plugin
STATE_DIR = "/var/lib/kspeedfs-csi"  # the plugin's volume records
CONFIG_DIR = "/etc/kspeedfs/config"  # the ConfigMap as a folder: edits reach it (no subPath)
CONFIG = f"{CONFIG_DIR}/kspeedfs.toml"
POLICY = f"{CONFIG_DIR}/policy.toml"
TOKEN = "/etc/kspeedfs/token/token"
READ_TOKEN_SECRET = "kspeedfs-read-token"  # `kspeedfs token new --role read`: for pods
LABELS = {"app.kubernetes.io/name": "kspeedfs", "app.kubernetes.io/component": "node"}
# The node's pods need host namespaces, hostPath and privilege: a namespace that enforces
# `baseline` (a hardened cluster's default) would create none of them.
PSA_LABELS = {
    f"pod-security.kubernetes.io/{mode}": "privileged" for mode in ("enforce", "audit", "warn")
}


def settings_toml(values: Values) -> str:
    """The settings every container reads (KSPEEDFS_CONFIG): peers by DNS, the token."""
    service = f"{SERVICE}.{values.namespace}.svc.{values.cluster_domain}"
    return "\n".join(
        [
            "# kspeedfs settings (docs/settings.md); the node's listen address comes from",
            "# KSPEEDFS_LISTEN, its pod IP (the host's: it runs on the host network), and its",
            "# memory budget from KSPEEDFS_MEMORY, its container's memory request.",
            f'nodes = ["dns:{service}:{values.port}"]',
            "# Looked up again this often: a node added to the DaemonSet joins, a gone one leaves.",
            "dns_refresh = 10",
            f'token_file = "{TOKEN}"',
            "# A volume's lease outlives a plugin restart of up to this many seconds.",
            "lease_ttl = 300",
            "",
        ]
    )


def _env_from_field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


DOWNWARD = [
    _env_from_field("NODE_NAME", "spec.nodeName"),
    _env_from_field("POD_IP", "status.podIP"),
    _env_from_field("HOST_IP", "status.hostIP"),
]


def _host_path(name: str, path: str, kind: str) -> dict[str, Any]:
    return {"name": name, "hostPath": {"path": path, "type": kind}}


def pod_address(port: int) -> str:
    """HOST:PORT of the pod's IP: bracketed, so that an IPv6 pod IP stays one host."""
    return f"[$(POD_IP)]:{port}"


def _node(values: Values, env: list[dict[str, Any]], config: list[dict[str, Any]]) -> Any:
    memory = {"resourceFieldRef": {"containerName": "node", "resource": "requests.memory"}}
    node_env = [
        *env,
        # The cache budget is the container's memory request, always in step with it: the
        # scheduler sees the cache (its tmpfs pages are charged to this container).
        {"name": "KSPEEDFS_MEMORY", "valueFrom": memory},
    ]
    ports = [{"name": "kspeedfs", "containerPort": values.port, "hostPort": values.port}]
    if values.metrics_port:
        # Only the node's env: a mount started by mountd would try the same port.
        node_env.append(
            {"name": "KSPEEDFS_METRICS_LISTEN", "value": pod_address(values.metrics_port)}
        )
        port = values.metrics_port
        ports.append({"name": "metrics", "containerPort": port, "hostPort": port})
    return {
        "name": "node",
        "image": values.image,
        "command": ["kspeedfs", "node"],
        "env": node_env,
        "ports": ports,
        "resources": values.resources_for("node"),
        "readinessProbe": {"tcpSocket": {"port": values.port}, "periodSeconds": 5},
        "livenessProbe": {
            "tcpSocket": {"port": values.port},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "volumeMounts": [
            *config,
            {"name": "shm", "mountPath": "/dev/shm"},
            # HostToContainer: a source mounted on the host after the pod started (NFS,
            # Lustre) is seen here too.
            {
                "name": "datasets",
                "mountPath": values.data_dir,
                "readOnly": True,
                "mountPropagation": "HostToContainer",
            },
        ],
    }


def install(values: Values) -> list[dict[str, Any]]:
    """The objects of an install, in the order `kubectl apply` should create them."""
    namespace, image, kubelet = values.namespace, values.image, values.kubelet_dir
    meta = {"namespace": namespace, "labels": LABELS}
    config_mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "token", "mountPath": "/etc/kspeedfs/token", "readOnly": True},
    ]
    common_env = [
        *DOWNWARD,
        {"name": "KSPEEDFS_CONFIG", "value": CONFIG},
        # Where the node listens, and for the mounts and the plugin which node is this
        # machine's (reads of its segments map them, no copy).
        {"name": "KSPEEDFS_LISTEN", "value": pod_address(values.port)},
    ]
    privileged = {"privileged": True}
    mountd = {
        "name": "mountd",
        "image": image,
        "command": [
            "kspeedfs-mountd",
            "--mounts-dir",
            f"{RUN_DIR}/mounts.d",
            "--state-file",
            f"{RUN_DIR}/mountd.json",
            "run",
        ],
        "env": common_env,
        "resources": values.resources_for("mountd"),
        "securityContext": privileged,  # /dev/fuse and mount(2) in the kubelet folder
        "volumeMounts": [
            *config_mounts,
            {"name": "kubelet", "mountPath": kubelet, "mountPropagation": "Bidirectional"},
            {"name": "run", "mountPath": RUN_DIR},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    health = {
        "name": "healthz",
        "containerPort": values.health_port,
        "hostPort": values.health_port,
    }
    plugin = {
        "name": "csi-plugin",
        "image": image,
        "command": [
            "kspeedfs",
            "csi",
            "--endpoint",
            "unix:///csi/csi.sock",
            "--node-id",
            "$(NODE_NAME)",
            "--state-dir",
            STATE_DIR,
            "--mounts-dir",
            f"{RUN_DIR}/mounts.d",
            "--mountd-state",
            f"{RUN_DIR}/mountd.json",
            "--kubelet-dir",
            kubelet,
            "--policy",
            POLICY,
        ],
        "env": common_env,
        "resources": values.resources_for("csi-plugin"),
        # Restarted when its Probe fails (the liveness-probe sidecar asks it, on healthz).
        "livenessProbe": {
            "httpGet": {"host": "127.0.0.1", "path": "/healthz", "port": "healthz"},
            "initialDelaySeconds": 10,
            "periodSeconds": 20,
            "timeoutSeconds": 10,
            "failureThreshold": 5,
        },
        "securityContext": privileged,  # clears a stale mount, signals mountd
        "volumeMounts": [
            *config_mounts,
            {"name": "plugin-dir", "mountPath": "/csi"},
            {"name": "kubelet", "mountPath": kubelet, "mountPropagation": "HostToContainer"},
            {"name": "run", "mountPath": RUN_DIR},
            {"name": "state", "mountPath": STATE_DIR},
        ],
    }
    registration = f"--kubelet-registration-path={values.plugin_dir}/csi.sock"
    registrar = {
        "name": "node-driver-registrar",
        "image": values.registrar_image,
        "args": ["--csi-address=/csi/csi.sock", registration],
        "resources": values.resources_for("node-driver-registrar"),
        # Restarted when kubelet does not know the plugin (lost registration after a kubelet
        # restart): the registrar's own check of it.
        "livenessProbe": {
            "exec": {
                "command": [
                    "/csi-node-driver-registrar",
                    registration,
                    "--mode=kubelet-registration-probe",
                ]
            },
            "initialDelaySeconds": 30,
            "periodSeconds": 60,
            "timeoutSeconds": 15,
        },
        "volumeMounts": [
            {"name": "plugin-dir", "mountPath": "/csi"},
            {"name": "registration-dir", "mountPath": "/registration"},
        ],
    }
    liveness = {
        "name": "liveness-probe",
        "image": values.livenessprobe_image,
        "args": [
            "--csi-address=/csi/csi.sock",
            f"--http-endpoint=127.0.0.1:{values.health_port}",
        ],
        "ports": [health],
        "resources": values.resources_for("liveness-probe"),
        "volumeMounts": [{"name": "plugin-dir", "mountPath": "/csi"}],
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": "kspeedfs-node",
        "automountServiceAccountToken": False,
        # Evicted last, OOM-killed last: with it go every kspeedfs volume of the machine.
        "priorityClassName": values.priority_class,
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "shareProcessNamespace": True,  # the plugin sends SIGHUP to mountd
        "terminationGracePeriodSeconds": 30,
        "nodeSelector": dict(values.node_selector),
        "tolerations": [dict(t) for t in values.tolerations],
        "containers": [
            _node(values, common_env, config_mounts),
            mountd,
            plugin,
            registrar,
            liveness,
        ],
        "volumes": [
            {"name": "config", "configMap": {"name": "kspeedfs-settings"}},
            {"name": "token", "secret": {"secretName": "kspeedfs-token"}},
            _host_path("shm", "/dev/shm", "Directory"),
            _host_path("datasets", values.data_dir, "DirectoryOrCreate"),
            _host_path("kubelet", kubelet, "Directory"),
            _host_path("plugin-dir", values.plugin_dir, "DirectoryOrCreate"),
            _host_path("registration-dir", f"{kubelet}/plugins_registry", "Directory"),
            # mountd's declarations and status live as long as the pod: a new
            # pod's plugin declares its recorded volumes again (state, below).
            {"name": "run", "emptyDir": {"medium": "Memory"}},
            _host_path("state", STATE_DIR, "DirectoryOrCreate"),
        ],
    }
    if values.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in values.image_pull_secrets]
    daemonset = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "kspeedfs-node", **meta},
        "spec": {
            "selector": {"matchLabels": LABELS},
            # A new pod replaces mountd, and with it the FUSE mounts of running pods: each
            # machine is upgraded when its pod is deleted (drained first), never all at once.
            "updateStrategy": {"type": "OnDelete"},
            "template": {"metadata": {"labels": LABELS}, "spec": pod_spec},
        },
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": namespace, "labels": PSA_LABELS},
        },
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "CSIDriver",
            "metadata": {"name": DRIVER_NAME, "labels": LABELS},
            "spec": {
                "attachRequired": False,
                "podInfoOnMount": True,
                "volumeLifecycleModes": ["Persistent", "Ephemeral"],
                "fsGroupPolicy": "None",  # read-only: nothing to chown
                "requiresRepublish": False,
            },
        },
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "kspeedfs-node", **meta},
            "automountServiceAccountToken": False,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "kspeedfs-node", **meta},
            # No container talks to the API server; this is all the account may do: read
            # its settings and the Service's endpoints (for `kubectl auth can-i` checks and
            # debugging pods run under it).
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    "resourceNames": ["kspeedfs-settings"],
                    "verbs": ["get"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "kspeedfs-node", **meta},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "kspeedfs-node",
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": "kspeedfs-node", "namespace": namespace}
            ],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "kspeedfs-settings", **meta},
            "data": {
                "kspeedfs.toml": settings_toml(values),
                "policy.toml": default_policy(namespace, values.data_dir),
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": SERVICE, **meta},
            "spec": {
                "clusterIP": "None",  # headless: the name's A records are the nodes
                "publishNotReadyAddresses": True,  # a starting node is named at once
                "selector": LABELS,
                "ports": [{"name": "kspeedfs", "port": values.port, "targetPort": values.port}],
            },
        },
        daemonset,
    ]


def examples(values: Values) -> list[dict[str, Any]]:
    """A pod with an inline (warm) volume, a PV and its PVC, and a preload Job."""
    namespace, image, source = values.namespace, values.image, f"{values.data_dir}/imagenet"
    token_volume = {"name": "token", "secret": {"secretName": "kspeedfs-token"}}
    job_env = [
        # No nodes setting in a pod: the node on the pod's host (HOST_IP).
        _env_from_field("HOST_IP", "status.hostIP"),
        {"name": "KSPEEDFS_TOKEN_FILE", "value": TOKEN},
    ]
    token_mount = {"name": "token", "mountPath": "/etc/kspeedfs/token", "readOnly": True}
    train = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "train-imagenet", "namespace": namespace},
        "spec": {
            # A restarted container gets the volume's live mount, should its mount process
            # have died (docs/kubernetes.md, "Upgrade").
            "restartPolicy": "OnFailure",
            "containers": [
                {
                    "name": "train",
                    "image": "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime",
                    "command": [
                        "python",
                        "-c",
                        "from torchvision.datasets import ImageFolder; "
                        "print(len(ImageFolder('/datasets/imagenet/train')))",
                    ],
                    "volumeMounts": [
                        {"name": "imagenet", "mountPath": "/datasets/imagenet", "readOnly": True}
                    ],
                }
            ],
            "volumes": [
                {
                    "name": "imagenet",
                    "csi": {
                        "driver": DRIVER_NAME,
                        "readOnly": True,
                        "volumeAttributes": {
                            "dataset": "imagenet",
                            # Not cached yet: loaded at publish, the pod starts warm; unloaded
                            # after the last pod using it ends (lifetime "job").
                            "source": source,
                            "lifetime": "job",
                        },
                    },
                }
            ],
        },
    }
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": "kspeedfs-imagenet"},
        "spec": {
            "capacity": {"storage": "150Gi"},  # informative: the cache decides what fits
            "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "csi": {
                "driver": DRIVER_NAME,
                "volumeHandle": "imagenet",  # the dataset's name
                "readOnly": True,
                "volumeAttributes": {"source": source, "lifetime": "persistent"},
            },
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "imagenet", "namespace": namespace},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": "kspeedfs-imagenet",
            "resources": {"requests": {"storage": "150Gi"}},
        },
    }
    preload_job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "preload-imagenet", "namespace": namespace},
        "spec": {
            "backoffLimit": 2,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "preload",
                            "image": image,
                            # Offline: kept until `kspeedfs unload imagenet`.
                            "command": [
                                "kspeedfs",
                                "preload",
                                source,
                                "--name",
                                "imagenet",
                                "-q",
                            ],
                            "env": job_env,
                            "volumeMounts": [token_mount],
                        }
                    ],
                    "volumes": [token_volume],
                }
            },
        },
    }
    return [train, pv, pvc, preload_job]


def render(values: Values, with_examples: bool = False) -> str:
    """The objects as one YAML stream (`kubectl apply -f -`)."""
    return to_yaml(install(values) + (examples(values) if with_examples else []))


def to_yaml(objects: list[dict[str, Any]]) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
        style = "|" if "\n" in data else None  # the settings file and scripts as written
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump_all(
        objects, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=100
    )


# The Kustomize base: one file per part, in the order `kubectl apply` should create them.
KUSTOMIZE_FILES = {
    "namespace.yaml": ("Namespace",),
    "csidriver.yaml": ("CSIDriver",),
    "rbac.yaml": ("ServiceAccount", "Role", "RoleBinding"),
    "config.yaml": ("ConfigMap",),
    "service.yaml": ("Service",),
    "daemonset.yaml": ("DaemonSet",),
}
KUSTOMIZATION_HEAD = """\
# Written by `kspeedfs kubernetes manifests --kustomize DIR` from values.yaml beside it;
#   kspeedfs kubernetes manifests --values DIR/values.yaml --kustomize DIR
# writes it again after a change of values (docs/kubernetes.md, "Install"). Change anything
# else in an overlay of your own (resources: [this folder], then patches; or images: to move
# the image to another tag).
"""


def values_yaml(values: Values) -> str:
    """The values as a `--values` file (every key, defaults included)."""
    import dataclasses

    from .values import KEYS

    keys = {f: k for k, f in KEYS.items()}
    data: dict[str, Any] = {}
    for f in dataclasses.fields(values):
        value = getattr(values, f.name)
        if isinstance(value, tuple):
            value = [dict(x) if not isinstance(x, str) else x for x in value]
        elif not isinstance(value, (str, int)):
            value = {k: v if isinstance(v, str) else dict(v) for k, v in value.items()}
        data[keys[f.name]] = value
    return '# kspeedfs install values (docs/kubernetes.md, "Values")\n' + to_yaml([data])


def write_kustomize(values: Values, folder: Path) -> list[Path]:
    """The Kustomize base of an install in `folder` (made if missing; its files replaced)."""
    objects = install(values)
    folder.mkdir(parents=True, exist_ok=True)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": list(KUSTOMIZE_FILES),
    }
    texts = {
        name: to_yaml([o for o in objects if o["kind"] in kinds])
        for name, kinds in KUSTOMIZE_FILES.items()
    }
    texts["kustomization.yaml"] = KUSTOMIZATION_HEAD + to_yaml([kustomization])
    texts["values.yaml"] = values_yaml(values)
    written = []
    for name, text in texts.items():
        path = folder / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
        written.append(path)
    return written
