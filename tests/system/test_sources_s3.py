"""Verified failover reads from an object store (moto's S3 server on 127.0.0.1)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import xxhash

from kspeedfs.format.errors import StaleDataset
from kspeedfs.sources.source import FsspecSource
from kspeedfs.testing.s3 import S3Server

BUCKET = "sources"
KEYS = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def bucket(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[tuple[Any, str]]:
    for k, v in KEYS.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3", endpoint_url=s3.endpoint)
    client.create_bucket(Bucket=BUCKET)
    prefix = tmp_path.name
    yield client, prefix


def test_read_verified_from_s3(s3: S3Server, bucket: tuple[Any, str]) -> None:
    client, prefix = bucket
    data = os.urandom(200_000)
    key = f"{prefix}/f.bin"
    client.put_object(Bucket=BUCKET, Key=key, Body=data)
    src = FsspecSource(f"s3://{BUCKET}/{prefix}", s3.endpoint)
    tree = src.scan()
    size = tree.size[1]
    assert src.read_verified(tree, 1, 5, 70_000) == data[5:70_005]
    whole = xxhash.xxh3_64_intdigest(data)
    assert src.read_verified(tree, 1, 0, size, whole) == data
    with pytest.raises(StaleDataset, match="checksum"):
        src.read_verified(tree, 1, 0, size, whole ^ 1)

    time.sleep(1.1)  # under test: a rewrite S3 dates later (its times step by one second)
    client.put_object(Bucket=BUCKET, Key=key, Body=data[::-1])
    with pytest.raises(StaleDataset):
        src.read_verified(tree, 1, 5, 70_000)
    client.put_object(Bucket=BUCKET, Key=key, Body=data[:1000])
    with pytest.raises(StaleDataset):
        src.read_verified(tree, 1, 5, 70_000)
    client.delete_object(Bucket=BUCKET, Key=key)
    with pytest.raises(StaleDataset):
        src.read_verified(tree, 1, 5, 70_000)
