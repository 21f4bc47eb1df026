"""What a source is called: whether it is a URL, the form the node records, the dataset name a
source gives. Apart from source.py so that the CLI and the clients, which only name sources,
do not import the readers (numpy, the manifest and layout formats) with them."""

from __future__ import annotations

import os
import re

from kspeedfs.sources.scan import check_source

URL_RE = re.compile(r"^([a-z][a-z0-9+.-]*)://(.*)$")


def is_url(source: str) -> bool:
    return URL_RE.match(source) is not None


def normalize_source(source: str) -> str:
    """The form the node records: an absolute, existing folder, or a URL as given."""
    if is_url(source):
        return source.rstrip("/") if not source.endswith("://") else source
    return os.path.abspath(check_source(source))


def name_from_source(source: str) -> str:
    """A dataset name derived from the source's last path part (`/nfs/imagenet` -> imagenet)."""
    m = URL_RE.match(source)
    path = m.group(2) if m else source
    last = path.rstrip("/").rsplit("/", 1)[-1].lower()
    name = re.sub(r"[^a-z0-9._-]+", "-", last).lstrip("._-")[:64]
    return name or "dataset"
