"""`import pytorch_ext` imports each name on first use: the datasets and samplers that need no
torchvision (about 1.7 s to import, paid again by every spawned DataLoader worker) import none,
checked in a fresh interpreter; every public name still resolves to its module's object."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pytorch_ext

TREE = Path(pytorch_ext.__file__).resolve().parent.parent

WITHOUT_TORCHVISION = [
    "ClairvoyantSampler",
    "KSpeedDataset",
    "KSpeedFolder",
    "KSpeedTarFolder",
    "KSpeedWebDataset",
    "MiniEpochSampler",
    "PrioritySampler",
    "release_leases",
]


def imported_after(names: list[str]) -> set[str]:
    """The top-level packages a fresh interpreter holds after `import pytorch_ext` and a use
    of each of `names`."""
    code = (
        "import sys, pytorch_ext\n"
        f"for name in {names!r}: getattr(pytorch_ext, name)\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TREE), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=TREE, env=env, capture_output=True, text=True, check=True
    )
    return set(done.stdout.split())


def test_datasets_that_need_no_torchvision_do_not_import_it() -> None:
    loaded = imported_after(WITHOUT_TORCHVISION)
    assert "pytorch_ext" in loaded and "torch" in loaded
    assert "torchvision" not in loaded


def test_the_image_folder_imports_torchvision_when_used() -> None:
    assert "torchvision" in imported_after(["KSpeedImageFolder"])


@pytest.mark.parametrize("name", pytorch_ext.__all__)
def test_every_public_name_is_its_modules_object(name: str) -> None:
    module, attr = pytorch_ext._WHERE[name]
    expected = getattr(importlib.import_module(f"pytorch_ext.{module}"), attr)
    assert getattr(pytorch_ext, name) is expected
    assert name in dir(pytorch_ext)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'KSpeedNothing'"):
        pytorch_ext.KSpeedNothing  # noqa: B018
    assert sorted(pytorch_ext._WHERE) == sorted(pytorch_ext.__all__)
