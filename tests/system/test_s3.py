"""Object storage sources against a real S3 API server (moto's server mode) on 127.0.0.1."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from conftest import MountProcess, NodeProcess, run_cli
from rt_util import EnvNode, cache_status, mount_source
from treeutil import walk

from kspeedfs.testing.process import START_TIMEOUT
from kspeedfs.testing.s3 import S3Server

pytestmark = pytest.mark.fuse

BUCKET = "kspeed-data"


class IamS3Server(S3Server):
    """moto's S3 server with IAM checks on: wrong keys are refused as on AWS."""

    def __init__(self, log_dir: Path):
        # The first three calls (make a user, its policy, its key) run unauthenticated.
        super().__init__(log_dir, env_extra={"INITIAL_NO_AUTH_ACTION_COUNT": "3"})

    def start(self, timeout: float = START_TIMEOUT) -> IamS3Server:
        super().start(timeout)
        iam = boto3.client("iam", **self._client_args("bootstrap", "bootstrap"))
        iam.create_user(UserName="trainer")
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        self.key, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
        self.s3 = boto3.client("s3", **self._client_args(self.key, self.secret))
        return self

    def _client_args(self, key: str, secret: str) -> dict[str, str]:
        return {
            "endpoint_url": self.endpoint,
            "region_name": "us-east-1",
            "aws_access_key_id": key,
            "aws_secret_access_key": secret,
        }

    def env(self, key: str | None = None, secret: str | None = None) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": key or self.key,
            "AWS_SECRET_ACCESS_KEY": secret or self.secret,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": "/dev/null",
            "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
        }


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IamS3Server]:
    server = IamS3Server(tmp_path_factory.mktemp("s3")).start()
    try:
        server.s3.create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture
def dataset(s3: IamS3Server, tmp_path: Path) -> tuple[str, Path]:
    """A local tree uploaded under a fresh prefix: nesting, non-ASCII names, a big object, an
    empty one. Returns (prefix, local copy)."""
    prefix = f"train-{uuid.uuid4().hex[:8]}"
    local = tmp_path / "local"
    files = {
        "n01/img_000.jpg": os.urandom(40_000),
        "n01/img_001.jpg": os.urandom(70_000),
        "n02/deep/img_002.jpg": os.urandom(5_000),
        "n02/ünïcødé-数据.jpg": b"non-ascii\n",
        "n02/empty.bin": b"",
        "big.bin": os.urandom((2 << 20) + 12345),
    }
    for i in range(20):
        files[f"n03/f{i:03d}.bin"] = os.urandom(1000 + 997 * i)
    for rel, data in files.items():
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(data)
        s3.s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{rel}", Body=data)
    return prefix, local


@pytest.fixture
def s3_node(s3: IamS3Server, token_file: Path, tmp_path: Path) -> Iterator[NodeProcess]:
    shm = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
    n = EnvNode(shm, token_file, tmp_path, env_extra=s3.env())
    try:
        yield n.start()
    finally:
        n.stop()
        shutil.rmtree(shm, ignore_errors=True)


def listing(node: NodeProcess) -> list[dict]:  # type: ignore[type-arg]
    done = run_cli("ls", "--json", env=node.env())
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_preload_from_s3_serves_every_byte(
    s3: IamS3Server,
    s3_node: NodeProcess,
    dataset: tuple[str, Path],
    tmp_path: Path,
    mounts: list[MountProcess],
) -> None:
    prefix, local = dataset
    url = f"s3://{BUCKET}/{prefix}"
    done = run_cli(
        "preload", url, "--name", "objects", "--endpoint", s3.endpoint, "-q", env=s3_node.env()
    )
    assert done.returncode == 0, done.stderr
    (entry,) = listing(s3_node)
    assert (entry["source"], entry["lifetime"], entry["files"]) == (url, "offline", 26)
    gets = s3.object_gets(BUCKET, prefix)
    assert gets >= 25  # every non-empty object was fetched
    m = MountProcess(tmp_path / "mnt", s3_node.env(), tmp_path)
    mounts.append(m)
    m.start()
    assert walk(m.mountpoint / "objects") == walk(local)
    assert s3.object_gets(BUCKET, prefix) == gets  # served from memory
    checksum = os.getxattr(m.mountpoint / "objects" / "big.bin", "user.kspeedfs.xxh3")
    assert checksum != b"0" * 16


def test_read_through_s3_second_pass_makes_no_requests(
    s3: IamS3Server,
    s3_node: NodeProcess,
    dataset: tuple[str, Path],
    tmp_path: Path,
    mounts: list[MountProcess],
) -> None:
    prefix, local = dataset
    url = f"s3://{BUCKET}/{prefix}/"
    first = mount_source(
        s3_node, tmp_path, mounts, url, "--endpoint", s3.endpoint, "--name", "coco"
    )
    assert s3.object_gets(BUCKET, prefix) == 0  # listing only
    assert walk(first.mountpoint) == walk(local)
    gets = s3.object_gets(BUCKET, prefix)
    st = cache_status(s3_node, "coco")
    assert gets == st["source_reads"] > 0
    assert st["in_memory"] == st["segments"]

    second = mount_source(
        s3_node, tmp_path, mounts, url, "--endpoint", s3.endpoint, "--name", "coco", mnt="mnt2"
    )
    assert walk(second.mountpoint) == walk(local)
    assert s3.object_gets(BUCKET, prefix) == gets
    assert "degraded" not in first.log() + second.log()


def test_wrong_credentials_and_missing_bucket_are_refused_and_change_nothing(
    s3: IamS3Server,
    s3_node: NodeProcess,
    dataset: tuple[str, Path],
    token_file: Path,
    tmp_path: Path,
) -> None:
    prefix, _local = dataset
    url = f"s3://{BUCKET}/{prefix}"
    shm = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
    wrong = EnvNode(shm, token_file, tmp_path, env_extra=s3.env("AKIAWRONGWRONGWRONG", "nope"))
    try:
        wrong.start()
        for args in (
            ("preload", url, "--name", "bad", "--endpoint", s3.endpoint, "-q"),
            ("mount", str(tmp_path / "mnt"), "--source", url, "--endpoint", s3.endpoint),
        ):
            (tmp_path / "mnt").mkdir(exist_ok=True)
            done = run_cli(*args, env=wrong.env())
            assert done.returncode == 9, done.stderr
            assert done.stderr.count("\n") == 1
            assert "refused" in done.stderr and "credentials" in done.stderr
        assert listing(wrong) == []
        assert not os.path.ismount(tmp_path / "mnt")
    finally:
        wrong.stop()
        shutil.rmtree(shm, ignore_errors=True)

    for source, code, words in (
        (f"s3://no-such-bucket-kspeed/{prefix}", 4, "not found"),
        (f"s3://{BUCKET}/no-such-prefix", 4, "no objects"),
        (f"s3://{BUCKET}/{prefix}/big.bin", 5, "not a folder"),
    ):
        done = run_cli(
            "preload",
            source,
            "--name",
            "bad",
            "--endpoint",
            s3.endpoint,
            "-q",
            env=s3_node.env(),
        )
        assert done.returncode == code, done.stderr
        assert done.stderr.count("\n") == 1
        assert words in done.stderr
    done = run_cli(
        "mount",
        str(tmp_path / "mnt"),
        "--source",
        f"s3://no-such-bucket-kspeed/{prefix}",
        "--endpoint",
        s3.endpoint,
        env=s3_node.env(),
    )
    assert done.returncode == 4, done.stderr
    assert listing(s3_node) == []
