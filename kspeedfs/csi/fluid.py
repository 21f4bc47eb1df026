"""`kspeedfs kubernetes manifests --fluid`: kspeedfs as a Fluid ThinRuntime (a profile whose FUSE
is `kspeedfs mount`, and a Dataset and ThinRuntime of it), valid against Fluid's published CRDs
(tests/data/fluid, checked in tests/system/test_k8s_manifests.py)."""

from __future__ import annotations

from typing import Any

from .manifests import READ_TOKEN_SECRET, TOKEN
from .values import Values, split_image

FLUID_MOUNT = """\
import json, os
config = json.load(open("/etc/fluid/config/config.json"))
name = config["mounts"][0]["mountPoint"].removeprefix("kspeedfs://")
os.makedirs(config["targetPath"], exist_ok=True)
os.execvp("kspeedfs", ["kspeedfs", "mount", config["targetPath"], "--foreground",
                       "--dataset", name, "-o", "allow_other"])
"""


def fluid_profile(values: Values) -> list[dict[str, Any]]:
    """A ThinRuntimeProfile whose FUSE is `kspeedfs mount`, and a Dataset and ThinRuntime of it.
    Fluid's FUSE pods are privileged by its own chart: the profile has no securityContext
    (Fluid's ThinFuseSpec has none; a strict apply refuses it)."""
    repo, tag = split_image(values.image)
    fuse: dict[str, Any] = {"image": repo}
    if tag:  # Fluid's chart writes image:imageTag, or the image alone without a tag
        fuse["imageTag"] = tag
    fuse.update(
        {
            "imagePullPolicy": "IfNotPresent",
            # Fluid writes the Dataset's mount points and the FUSE target folder to
            # /etc/fluid/config/config.json (Fluid >= 1.1); `kspeedfs://NAME` names a cached
            # dataset. The node is the one on the host (HOST_IP), as for any kspeedfs client
            # in a pod.
            "command": ["python3", "-c", FLUID_MOUNT],
            "env": [
                {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
                {"name": "KSPEEDFS_TOKEN_FILE", "value": TOKEN},
            ],
            "volumeMounts": [
                {"name": "token", "mountPath": "/etc/kspeedfs/token", "readOnly": True}
            ],
        }
    )
    if values.image_pull_secrets:
        fuse["imagePullSecrets"] = [{"name": s} for s in values.image_pull_secrets]
    return [
        {
            "apiVersion": "data.fluid.io/v1alpha1",
            "kind": "ThinRuntimeProfile",
            "metadata": {"name": "kspeedfs"},
            "spec": {
                "fileSystemType": "fuse.kspeedfs",
                "fuse": fuse,
                # A read-role token (`kspeedfs token new --role read`), in each Dataset's
                # namespace: Fluid runs the FUSE pods there.
                "volumes": [{"name": "token", "secret": {"secretName": READ_TOKEN_SECRET}}],
            },
        },
        {
            "apiVersion": "data.fluid.io/v1alpha1",
            "kind": "Dataset",
            "metadata": {"name": "imagenet", "namespace": values.namespace},
            "spec": {"mounts": [{"mountPoint": "kspeedfs://imagenet", "name": "imagenet"}]},
        },
        {
            "apiVersion": "data.fluid.io/v1alpha1",
            "kind": "ThinRuntime",
            "metadata": {"name": "imagenet", "namespace": values.namespace},
            "spec": {"profileName": "kspeedfs"},
        },
    ]
