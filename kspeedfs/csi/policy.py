"""Who may publish what: the admin's volume policy (policy.toml in the ConfigMap), checked at
NodePublishVolume against the pod's namespace that kubelet sends (podInfoOnMount).

Without it, any namespace's inline volume could load any path the node sees, or any s3://
prefix the node's credentials reach, with the cluster token, and pin it (`lifetime:
persistent`); inline CSI volumes are allowed even in `restricted` namespaces, where hostPath is
not. So a namespace uses only what a rule names: the datasets (fnmatch patterns), the source
prefixes a volume may load from, and whether it may load and pin. The file is read again at
each publish (a ConfigMap change applies without a restart); one that cannot be read refuses
every publish (closed, not open), in one line.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import tomllib
from pathlib import Path
from typing import Any

from kspeedfs.format.errors import InvalidArgument, KSpeedError

from .volumes import POD_PREFIX, Volume

NAMESPACE_KEY = POD_PREFIX + "pod.namespace"
RULE_KEYS = frozenset({"namespaces", "datasets", "sources", "load", "pin"})


class NotAllowed(KSpeedError):
    """The policy does not let this pod's namespace publish this volume."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """One `[[allow]]` table: these namespaces may use these datasets (and load and pin)."""

    namespaces: tuple[str, ...]
    datasets: tuple[str, ...] = ("*",)
    sources: tuple[str, ...] = ()  # prefixes a volume may load from; none: cached datasets only
    load: bool = False  # may a volume load a dataset that is not cached
    pin: bool = False  # may a volume ask lifetime = persistent (kept after its last pod)

    def covers(self, namespace: str, dataset: str) -> bool:
        return any(fnmatch.fnmatchcase(namespace, n) for n in self.namespaces) and any(
            fnmatch.fnmatchcase(dataset, d) for d in self.datasets
        )


def under(source: str, prefix: str) -> bool:
    """`source` is `prefix` or inside it, path-wise (`/data/a` is not under `/data/ab`; `..`
    cannot climb out: both are normalized first)."""
    if source.startswith("s3://") != prefix.startswith("s3://"):
        return False
    scheme = "s3://" if source.startswith("s3://") else ""
    src = os.path.normpath("/" + source.removeprefix(scheme))
    pre = os.path.normpath("/" + prefix.removeprefix(scheme))
    return src == pre or src.startswith(pre.rstrip("/") + "/")


def _strings(path: Path, key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
        raise InvalidArgument(f"policy {path}: {key} must be a list of strings")
    return tuple(value)


def parse_policy(path: Path, text: str) -> list[Rule]:
    """The rules of a policy file; InvalidArgument in one line for anything it cannot mean."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InvalidArgument(f"policy {path}: {' '.join(str(e).split())}") from None
    unknown = sorted(set(data) - {"allow"})
    if unknown:
        raise InvalidArgument(f"policy {path}: unknown key {unknown[0]!r} (known: allow)")
    tables = data.get("allow", [])
    if not isinstance(tables, list):
        raise InvalidArgument(f"policy {path}: allow must be [[allow]] tables")
    rules = []
    for table in tables:
        if not isinstance(table, dict):
            raise InvalidArgument(f"policy {path}: allow must be [[allow]] tables")
        bad = sorted(set(table) - RULE_KEYS)
        if bad:
            raise InvalidArgument(
                f"policy {path}: unknown key {bad[0]!r} in [[allow]] "
                f"(known: {', '.join(sorted(RULE_KEYS))})"
            )
        if "namespaces" not in table:
            raise InvalidArgument(f"policy {path}: an [[allow]] table names no namespaces")
        for flag in ("load", "pin"):
            if not isinstance(table.get(flag, False), bool):
                raise InvalidArgument(f"policy {path}: {flag} must be true or false")
        sources = _strings(path, "sources", table.get("sources", []))
        for s in sources:
            if not (s.startswith("/") or s.startswith("s3://")):
                raise InvalidArgument(
                    f"policy {path}: sources are absolute paths or s3:// prefixes: {s!r}"
                )
        rules.append(
            Rule(
                namespaces=_strings(path, "namespaces", table["namespaces"]),
                datasets=_strings(path, "datasets", table.get("datasets", ["*"])),
                sources=sources,
                load=table.get("load", False),
                pin=table.get("pin", False),
            )
        )
    return rules


@dataclasses.dataclass(frozen=True)
class Grant:
    """What the policy lets one publish do: load a dataset that is not cached, or not."""

    may_load: bool


class VolumePolicy:
    """The policy file, read at each check; `path` None: no policy, everything allowed (a
    plugin run by hand or in tests)."""

    def __init__(self, path: Path | None):
        self.path = path

    def rules(self) -> list[Rule]:
        assert self.path is not None
        try:
            text = self.path.read_text()
        except OSError as e:
            raise NotAllowed(
                f"the volume policy {self.path} cannot be read ({e.strerror}): every publish is "
                f"refused until it can"
            ) from None
        try:
            return parse_policy(self.path, text)
        except InvalidArgument as e:
            raise NotAllowed(f"{e}: every publish is refused until it is fixed") from None

    def check(self, volume: Volume, context: dict[str, str]) -> Grant:
        """The grant for `volume` published for the pod that `context` names; NotAllowed in
        one line (the pod's events show it) naming what the policy does not allow."""
        if self.path is None:
            return Grant(may_load=True)
        namespace = context.get(NAMESPACE_KEY, "")
        if not namespace:
            raise NotAllowed(
                "the volume context names no pod namespace (the CSIDriver needs podInfoOnMount: "
                "true), so the volume policy cannot allow it"
            )
        rules = [r for r in self.rules() if r.covers(namespace, volume.dataset)]
        where = f"(volume policy {self.path})"
        if not rules:
            raise NotAllowed(f"namespace {namespace} may not use dataset {volume.dataset} {where}")
        if volume.lifetime == "persistent" and not any(r.pin for r in rules):
            raise NotAllowed(
                f"namespace {namespace} may not pin dataset {volume.dataset} "
                f"(lifetime: persistent) {where}"
            )
        if volume.source:
            rules = [r for r in rules if any(under(volume.source, p) for p in r.sources)]
            if not rules:
                raise NotAllowed(
                    f"namespace {namespace} may not load from {volume.source} "
                    f"(not under its sources) {where}"
                )
        return Grant(may_load=any(r.load for r in rules) and bool(volume.source))


def default_policy(namespace: str, data_dir: str) -> str:
    """The policy the manifests install: the install's own namespace (its preload Job and the
    examples) may use any dataset, load from the data folder and pin; no other namespace may
    use a kspeedfs volume until a rule names it."""
    return "\n".join(
        [
            '# Which namespaces may publish kspeedfs volumes (docs/kubernetes.md, "Volumes only',
            '# where allowed"). A namespace no [[allow]] names is refused at publish, in one line',
            "# in the pod's events. Read at each publish: an edit applies without a restart.",
            "[[allow]]",
            f'namespaces = ["{namespace}"]',
            'datasets = ["*"]        # fnmatch patterns of dataset names',
            f'sources = ["{data_dir}"]  # prefixes a volume may load from ([]: cached datasets only)',
            "load = true             # may load a dataset that is not cached (from sources)",
            "pin = true              # may ask lifetime: persistent (kept after its last pod)",
            "",
            "# A team that reads what the admins preloaded, and loads its own bucket for its jobs:",
            "# [[allow]]",
            '# namespaces = ["team-vision"]',
            '# datasets = ["imagenet", "vision-*"]',
            '# sources = ["s3://vision-datasets/"]',
            "# load = true",
            "# pin = false",
            "",
        ]
    )
