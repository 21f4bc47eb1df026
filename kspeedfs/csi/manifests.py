"""`kspeedfs kubernetes manifests`: what installs kspeedfs on a cluster, as Kubernetes objects.

One DaemonSet pod per machine runs four containers that share one process namespace:
- `node`: `kspeedfs node` on the host network (port 7420), its segments in the host's /dev/shm
  (they outlive the container, and jobs on the machine map them), its peers named by the
  headless Service's DNS name (`nodes = ["dns:..."]` in the ConfigMap);
- `mountd`: `kspeedfs-mountd`, the owner of every volume's FUSE mount, with the kubelet folder
  shared both ways (mountPropagation Bidirectional), so a mount it makes reaches the host and
  kubelet's bind into the pod;
- `csi-plugin`: `kspeedfs csi`, which declares the volumes to mountd; it can be killed or
  upgraded without touching a mount (docs/kubernetes.md, "Upgrade");
- `node-driver-registrar`: registers the plugin's socket with kubelet.

Every object here validates against the Kubernetes schemas of 1.29 through 1.37 with unknown
fields refused (tests/system/test_k8s_manifests.py, the `kubernetes-validate` package).
"""

from __future__ import annotations

from typing import Any

from .volumes import DRIVER_NAME

DEFAULT_NAMESPACE = "kspeedfs"
DEFAULT_IMAGE = "ghcr.io/kspeedfs/kspeedfs:0.1.0"
REGISTRAR_IMAGE = "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.13.0"
SERVICE = "kspeedfs-nodes"
PORT = 7420
KUBELET = "/var/lib/kubelet"
PLUGIN_DIR = f"{KUBELET}/plugins/{DRIVER_NAME}"
RUN_DIR = "/run/kspeedfs-csi"  # mountd's declarations and status, shared with the plugin
STATE_DIR = "/var/lib/kspeedfs-csi"  # the plugin's volume records
CONFIG = "/etc/kspeedfs/kspeedfs.toml"
TOKEN = "/etc/kspeedfs/token/token"
LABELS = {"app.kubernetes.io/name": "kspeedfs", "app.kubernetes.io/component": "node"}


def settings_toml(namespace: str) -> str:
    """The settings every container reads (KSPEEDFS_CONFIG): peers by DNS, the token."""
    return "\n".join(
        [
            "# kspeedfs settings (docs/settings.md); the node's listen address comes from",
            "# KSPEEDFS_LISTEN, its pod IP (the host's: it runs on the host network).",
            f'nodes = ["dns:{SERVICE}.{namespace}.svc.cluster.local:{PORT}"]',
            "# Looked up again this often: a node added to the DaemonSet joins, a gone one leaves.",
            "dns_refresh = 10",
            f'token_file = "{TOKEN}"',
            'memory = "50%"',
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


def install(namespace: str, image: str) -> list[dict[str, Any]]:
    """The objects of an install, in the order `kubectl apply` should create them."""
    meta = {"namespace": namespace, "labels": LABELS}
    config_mounts = [
        {"name": "config", "mountPath": "/etc/kspeedfs/kspeedfs.toml", "subPath": "kspeedfs.toml"},
        {"name": "token", "mountPath": "/etc/kspeedfs/token", "readOnly": True},
    ]
    common_env = [
        *DOWNWARD,
        {"name": "KSPEEDFS_CONFIG", "value": CONFIG},
        # Where the node listens, and for the mounts and the plugin which node is this
        # machine's (reads of its segments map them, no copy).
        {"name": "KSPEEDFS_LISTEN", "value": f"$(POD_IP):{PORT}"},
    ]
    privileged = {"privileged": True}
    node = {
        "name": "node",
        "image": image,
        "command": ["kspeedfs", "node"],
        "env": common_env,
        "ports": [{"name": "kspeedfs", "containerPort": PORT, "hostPort": PORT}],
        "readinessProbe": {"tcpSocket": {"port": PORT}, "periodSeconds": 5},
        "volumeMounts": [
            *config_mounts,
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "datasets", "mountPath": "/data", "readOnly": True},
        ],
    }
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
        "securityContext": privileged,  # /dev/fuse and mount(2) in the kubelet folder
        "volumeMounts": [
            *config_mounts,
            {"name": "kubelet", "mountPath": KUBELET, "mountPropagation": "Bidirectional"},
            {"name": "run", "mountPath": RUN_DIR},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
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
        ],
        "env": common_env,
        "securityContext": privileged,  # clears a stale mount, signals mountd
        "volumeMounts": [
            *config_mounts,
            {"name": "plugin-dir", "mountPath": "/csi"},
            {"name": "kubelet", "mountPath": KUBELET, "mountPropagation": "HostToContainer"},
            {"name": "run", "mountPath": RUN_DIR},
            {"name": "state", "mountPath": STATE_DIR},
        ],
    }
    registrar = {
        "name": "node-driver-registrar",
        "image": REGISTRAR_IMAGE,
        "args": [
            "--csi-address=/csi/csi.sock",
            f"--kubelet-registration-path={PLUGIN_DIR}/csi.sock",
        ],
        "volumeMounts": [
            {"name": "plugin-dir", "mountPath": "/csi"},
            {"name": "registration-dir", "mountPath": "/registration"},
        ],
    }
    daemonset = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "kspeedfs-node", **meta},
        "spec": {
            "selector": {"matchLabels": LABELS},
            # A new pod replaces mountd, and with it the FUSE mounts of running pods: each
            # machine is upgraded when its pod is deleted (drained first), never all at once.
            "updateStrategy": {"type": "OnDelete"},
            "template": {
                "metadata": {"labels": LABELS},
                "spec": {
                    "serviceAccountName": "kspeedfs-node",
                    "automountServiceAccountToken": False,
                    "hostNetwork": True,
                    "dnsPolicy": "ClusterFirstWithHostNet",
                    "shareProcessNamespace": True,  # the plugin sends SIGHUP to mountd
                    "terminationGracePeriodSeconds": 30,
                    "tolerations": [{"operator": "Exists"}],
                    "containers": [node, mountd, plugin, registrar],
                    "volumes": [
                        {"name": "config", "configMap": {"name": "kspeedfs-settings"}},
                        {"name": "token", "secret": {"secretName": "kspeedfs-token"}},
                        _host_path("shm", "/dev/shm", "Directory"),
                        _host_path("datasets", "/data", "DirectoryOrCreate"),
                        _host_path("kubelet", KUBELET, "Directory"),
                        _host_path("plugin-dir", PLUGIN_DIR, "DirectoryOrCreate"),
                        _host_path("registration-dir", f"{KUBELET}/plugins_registry", "Directory"),
                        # mountd's declarations and status live as long as the pod: a new
                        # pod's plugin declares its recorded volumes again (state, below).
                        {"name": "run", "emptyDir": {"medium": "Memory"}},
                        _host_path("state", STATE_DIR, "DirectoryOrCreate"),
                    ],
                },
            },
        },
    }
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
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
            "data": {"kspeedfs.toml": settings_toml(namespace)},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": SERVICE, **meta},
            "spec": {
                "clusterIP": "None",  # headless: the name's A records are the nodes
                "publishNotReadyAddresses": True,  # a starting node is named at once
                "selector": LABELS,
                "ports": [{"name": "kspeedfs", "port": PORT, "targetPort": PORT}],
            },
        },
        daemonset,
    ]


def examples(namespace: str, image: str) -> list[dict[str, Any]]:
    """A pod with an inline (warm) volume, a PV and its PVC, and a preload Job."""
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
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "train",
                    "image": "pytorch/pytorch:latest",
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
                            "source": "/data/imagenet",
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
                "volumeAttributes": {"source": "/data/imagenet", "lifetime": "persistent"},
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
                                "/data/imagenet",
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


FLUID_MOUNT = """\
import json, os
config = json.load(open("/etc/fluid/config/config.json"))
name = config["mounts"][0]["mountPoint"].removeprefix("kspeedfs://")
os.makedirs(config["targetPath"], exist_ok=True)
os.execvp("kspeedfs", ["kspeedfs", "mount", config["targetPath"], "--foreground",
                       "--dataset", name, "-o", "allow_other"])
"""


def fluid_profile(namespace: str, image: str) -> list[dict[str, Any]]:
    """For Fluid users: a ThinRuntimeProfile whose FUSE is `kspeedfs mount`, and a Dataset
    and ThinRuntime of it (Fluid's CRDs: not in the Kubernetes schemas, checked by Fluid)."""
    return [
        {
            "apiVersion": "data.fluid.io/v1alpha1",
            "kind": "ThinRuntimeProfile",
            "metadata": {"name": "kspeedfs"},
            "spec": {
                "fileSystemType": "fuse.kspeedfs",
                "fuse": {
                    "image": image.rsplit(":", 1)[0],
                    "imageTag": image.rsplit(":", 1)[1] if ":" in image else "latest",
                    "imagePullPolicy": "IfNotPresent",
                    # Fluid writes the Dataset's mount points and the FUSE target folder to
                    # /etc/fluid/config/config.json (Fluid >= 1.1); `kspeedfs://NAME` names a
                    # cached dataset. The node is the one on the host (HOST_IP), as for any
                    # kspeedfs client in a pod.
                    "command": ["python3", "-c", FLUID_MOUNT],
                    "env": [
                        _env_from_field("HOST_IP", "status.hostIP"),
                        {"name": "KSPEEDFS_TOKEN_FILE", "value": TOKEN},
                    ],
                    "securityContext": {"privileged": True},
                    "volumeMounts": [
                        {"name": "token", "mountPath": "/etc/kspeedfs/token", "readOnly": True}
                    ],
                },
                "volumes": [{"name": "token", "secret": {"secretName": "kspeedfs-token"}}],
            },
        },
        {
            "apiVersion": "data.fluid.io/v1alpha1",
            "kind": "Dataset",
            "metadata": {"name": "imagenet", "namespace": namespace},
            "spec": {"mounts": [{"mountPoint": "kspeedfs://imagenet", "name": "imagenet"}]},
        },
        {
            "apiVersion": "data.fluid.io/v1alpha1",
            "kind": "ThinRuntime",
            "metadata": {"name": "imagenet", "namespace": namespace},
            "spec": {"profileName": "kspeedfs"},
        },
    ]


def render(
    namespace: str = DEFAULT_NAMESPACE,
    image: str = DEFAULT_IMAGE,
    with_examples: bool = False,
    fluid: bool = False,
) -> str:
    """The objects as one YAML stream (`kubectl apply -f -`)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
        style = "|" if "\n" in data else None  # the settings file and scripts as written
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    Dumper.add_representer(str, text)
    if fluid:
        objects = fluid_profile(namespace, image)
    else:
        objects = install(namespace, image) + (examples(namespace, image) if with_examples else [])
    return yaml.dump_all(
        objects, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=100
    )
