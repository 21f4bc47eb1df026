"""The volume policy in process: its file's rules, prefixes path-wise, and what each rule
grants, with hostile sources and names from hypothesis."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kspeedfs.csi.policy import NotAllowed, VolumePolicy, default_policy, parse_policy, under
from kspeedfs.csi.volumes import Volume
from kspeedfs.format.errors import InvalidArgument

RULES = """
[[allow]]
namespaces = ["team-a"]
datasets = ["vision-*"]
sources = ["/data/vision", "s3://bucket/vision/"]
load = true

[[allow]]
namespaces = ["ops"]
pin = true
"""


def volume(dataset: str, source: str = "", lifetime: str = "job") -> Volume:
    return Volume(volume_id="v", target="/t", dataset=dataset, source=source, lifetime=lifetime)


def context(namespace: str) -> dict[str, str]:
    return {"csi.storage.k8s.io/pod.namespace": namespace}


@pytest.fixture
def policy(tmp_path: Path) -> VolumePolicy:
    path = tmp_path / "policy.toml"
    path.write_text(RULES)
    return VolumePolicy(path)


def test_prefixes_are_path_wise() -> None:
    assert under("/data/vision", "/data/vision")
    assert under("/data/vision/train", "/data/vision/")
    assert not under("/data/visionary", "/data/vision")
    assert not under("/data/vision/../secrets", "/data/vision")
    assert not under("/etc", "/data")
    assert under("s3://bucket/vision/a", "s3://bucket/vision/")
    assert not under("s3://bucket/visionary", "s3://bucket/vision")
    assert not under("/bucket/vision", "s3://bucket/vision")
    assert not under("s3://bucket/vision", "/bucket/vision")


def test_grants(policy: VolumePolicy) -> None:
    assert policy.check(volume("vision-a", "/data/vision/a"), context("team-a")).may_load
    assert not policy.check(volume("vision-a"), context("team-a")).may_load  # no source
    assert not policy.check(volume("anything"), context("ops")).may_load  # cached only
    assert policy.check(volume("anything", lifetime="persistent"), context("ops"))
    for vol, ns, why in [
        (volume("vision-a"), "team-b", "namespace team-b may not use dataset vision-a"),
        (volume("text"), "team-a", "may not use dataset text"),
        (volume("vision-a", "/data/other"), "team-a", "not under its sources"),
        (volume("vision-a", "s3://bucket/other"), "team-a", "not under its sources"),
        (volume("vision-a", "/data/vision", "persistent"), "team-a", "may not pin"),
        (volume("x", "/data/x"), "ops", "not under its sources"),
        (volume("vision-a"), "", "podInfoOnMount"),
    ]:
        with pytest.raises(NotAllowed, match=why):
            policy.check(vol, context(ns) if ns else {})


def test_no_policy_allows_everything() -> None:
    assert VolumePolicy(None).check(volume("x", "/anywhere"), {}).may_load


def test_the_default_policy_allows_its_namespace_only() -> None:
    rules = parse_policy(Path("p"), default_policy("kspeedfs", "/data"))
    assert len(rules) == 1 and rules[0].namespaces == ("kspeedfs",)
    assert rules[0].covers("kspeedfs", "imagenet") and not rules[0].covers("team", "imagenet")


@pytest.mark.parametrize(
    "text, why",
    [
        ("allow = 3", "allow must be"),
        ("[[allow]]\ndatasets = ['a']", "names no namespaces"),
        ("[[allow]]\nnamespaces = ['a']\nload = 'yes'", "load must be true or false"),
        ("[[allow]]\nnamespaces = ['a']\nsources = ['relative']", "absolute paths or s3://"),
        ("[[allow]]\nnamespaces = ['a']\ncolour = 1", "unknown key 'colour'"),
        ("deny = []", "unknown key 'deny'"),
        ("[[allow]\n", "policy"),
    ],
)
def test_bad_files_are_one_line(text: str, why: str) -> None:
    with pytest.raises(InvalidArgument, match=why) as caught:
        parse_policy(Path("p.toml"), text)
    assert "\n" not in str(caught.value)


def test_an_unreadable_policy_refuses_every_publish(tmp_path: Path) -> None:
    missing = VolumePolicy(tmp_path / "none.toml")
    with pytest.raises(NotAllowed, match="cannot be read"):
        missing.check(volume("x"), context("ops"))
    broken = tmp_path / "broken.toml"
    broken.write_text("[[allow]]\nnamespaces = 1\n")
    with pytest.raises(NotAllowed, match="refused until it is fixed"):
        VolumePolicy(broken).check(volume("x"), context("ops"))


@given(st.text(max_size=60), st.sampled_from(["/data/vision", "/data/vision/", "s3://b/v/"]))
def test_hostile_sources_never_escape_their_prefix(source: str, prefix: str) -> None:
    if "\x00" in source:
        return
    if under(source, prefix):
        scheme = "s3://" if prefix.startswith("s3://") else ""
        assert source.startswith(scheme)
        resolved = os.path.normpath("/" + source.removeprefix(scheme))
        base = os.path.normpath("/" + prefix.removeprefix(scheme))
        assert resolved == base or resolved.startswith(base + "/")
        assert ".." not in resolved.split("/")


@given(st.text(max_size=30), st.text(max_size=30))
def test_hostile_files_are_refused_in_one_line(namespaces: str, sources: str) -> None:
    text = f"[[allow]]\nnamespaces = {namespaces}\nsources = {sources}\n"
    try:
        parse_policy(Path("p.toml"), text)
    except InvalidArgument as e:
        assert "\n" not in str(e)
