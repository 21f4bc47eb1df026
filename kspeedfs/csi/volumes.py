"""A CSI volume as kspeedfs reads it: what a publish asks for, checked, and its record on disk.

The records (one JSON file per published target in the plugin's state folder) are how a plugin
that was killed or upgraded finds its volumes again: the mounts themselves belong to mountd,
whose processes outlive the plugin, and the leases of warm volumes are renewed again from here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from kspeedfs.format.errors import InvalidArgument
from kspeedfs.format.names import validate_name

DRIVER_NAME = "csi.kspeedfs.io"
LIFETIMES = ("job", "persistent")
# Keys of volumeAttributes (inline volumes) or of a PV's volumeAttributes; the pod's details
# that kubelet adds with podInfoOnMount (csi.storage.k8s.io/...) are kept, never required.
ATTRIBUTES = frozenset({"dataset", "source", "lifetime", "decoded"})
POD_PREFIX = "csi.storage.k8s.io/"
MAX_DECODED = 4096


@dataclasses.dataclass(frozen=True)
class Volume:
    """One published volume: the dataset it shows at its target path, read-only."""

    volume_id: str
    target: str
    dataset: str
    source: str = ""  # preloaded from here at publish when the dataset is not cached
    lifetime: str = "job"  # job: unloaded with the last volume that loaded it
    decoded: int = 0  # 0: the files as they are; N: the decoded variant NAME@N at the target
    ephemeral: bool = False
    pod: str = ""  # namespace/name of the pod, for logs
    lease: str = ""  # the lease this volume holds on its dataset ("" none)
    lease_home: str = ""  # the node that granted it

    def compatible(self, other: Volume) -> bool:
        """A second publish at the same target asks for this same volume (leases aside)."""
        keys = ("volume_id", "target", "dataset", "source", "lifetime", "decoded")
        return all(getattr(self, k) == getattr(other, k) for k in keys)

    @property
    def mounted(self) -> str:
        """What the target shows: the dataset, or its decoded variant (`NAME@N`, which the
        mount starts when the node has none yet)."""
        return f"{self.dataset}@{self.decoded}" if self.decoded else self.dataset

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Volume:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


def volume_from_request(
    volume_id: str, target: str, context: dict[str, str], readonly: bool
) -> Volume:
    """The volume a NodePublishVolume asks for; InvalidArgument in one line when it cannot be
    served. Inline volumes name their dataset in `dataset`; a PV's volumeHandle is the dataset
    unless its attributes name one."""
    if not volume_id:
        raise InvalidArgument("volume_id is missing")
    if not target:
        raise InvalidArgument("target_path is missing")
    if not os.path.isabs(target) or "\x00" in target:
        raise InvalidArgument(f"target_path must be an absolute path: {target!r}")
    attrs = {k: v for k, v in context.items() if not k.startswith(POD_PREFIX)}
    unknown = sorted(set(attrs) - ATTRIBUTES)
    if unknown:
        raise InvalidArgument(
            f"unknown volume attribute {unknown[0]!r} (known: {', '.join(sorted(ATTRIBUTES))})"
        )
    ephemeral = context.get(POD_PREFIX + "ephemeral") == "true"
    dataset = attrs.get("dataset") or ("" if ephemeral else volume_id)
    if not dataset:
        raise InvalidArgument("an inline volume needs the attribute dataset")
    try:
        validate_name(dataset)
    except InvalidArgument as e:
        raise InvalidArgument(f"dataset: {e}") from None
    source = attrs.get("source", "")
    if source and not (os.path.isabs(source) or source.startswith("s3://")):
        raise InvalidArgument(f"source must be an absolute path or s3:// URL: {source!r}")
    lifetime = attrs.get("lifetime", "job")
    if lifetime not in LIFETIMES:
        raise InvalidArgument(f"lifetime must be one of {', '.join(LIFETIMES)}: {lifetime!r}")
    decoded_text = attrs.get("decoded", "0") or "0"
    if not decoded_text.isdigit() or not 0 <= int(decoded_text) <= MAX_DECODED:
        raise InvalidArgument(
            f"decoded must be a size in pixels (0-{MAX_DECODED}): {decoded_text!r}"
        )
    pod = context.get(POD_PREFIX + "pod.namespace", "")
    if pod:
        pod += "/" + context.get(POD_PREFIX + "pod.name", "")
    return Volume(
        volume_id=volume_id,
        target=os.path.normpath(target),
        dataset=dataset,
        source=source,
        lifetime=lifetime,
        decoded=int(decoded_text),
        ephemeral=ephemeral,
        pod=pod,
    )


def mount_name(target: str) -> str:
    """The mountd declaration name of a target: stable, short, a valid systemd instance name."""
    digest = hashlib.sha256(os.path.normpath(target).encode()).hexdigest()[:20]
    return f"csi-{digest}"


class VolumeRecords:
    """The plugin's state folder: one record per published target, written atomically."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)

    def path(self, target: str) -> Path:
        return self.folder / f"{mount_name(target)}.json"

    def get(self, target: str) -> Volume | None:
        try:
            with open(self.path(target)) as f:
                return Volume.from_json(json.load(f))
        except FileNotFoundError:
            return None

    def put(self, volume: Volume) -> None:
        path = self.path(volume.target)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w") as f:
            json.dump(volume.to_json(), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def remove(self, target: str) -> None:
        try:
            self.path(target).unlink()
        except FileNotFoundError:
            pass

    def all(self) -> list[Volume]:
        out = []
        for path in sorted(self.folder.glob("csi-*.json")):
            try:
                with open(path) as f:
                    out.append(Volume.from_json(json.load(f)))
            except (OSError, ValueError, TypeError):
                continue  # a record half written by a plugin killed in os.replace's window
        return out
