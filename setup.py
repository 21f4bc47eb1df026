"""Installs kspeedfs_watch.pth beside the packages (pyproject.toml holds everything else): the
hook that makes KSPEEDFS_WATCH=1 watch every DataLoader (pytorch_ext.watch_hook). A wheel gets
it from build_py, an editable install (`pip install -e`) from its editable wheel."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "kspeedfs_watch.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(PTH, str(Path(self.build_lib, PTH)), preserve_mode=0)


class EditableWheelWithPth(editable_wheel):
    def _install_namespaces(self, installation_dir, pth_prefix):  # type: ignore[no-untyped-def]
        super()._install_namespaces(installation_dir, pth_prefix)
        shutil.copy(PTH, Path(installation_dir, PTH))


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
