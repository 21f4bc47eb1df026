"""One logging setup for every kspeedfs command (CLI, mount helper, mountd)."""

from __future__ import annotations

import logging


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
