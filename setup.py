"""setuptools hook of flashinfer-h3 (the configuration is in pyproject.toml).

setuptools builds a wheel in ``./build/lib`` and copies files there without removing old ones,
so a header deleted or moved under ``templates/`` since an earlier build of this checkout would
still be shipped; it would also change every kernel's source key (they hash every header), so no
prebuilt kernel would match the installed package. ``build_py`` starts from an empty package
tree instead.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class CleanBuildPy(build_py):
    def run(self) -> None:
        shutil.rmtree(Path(self.build_lib) / "flashinfer_h3", ignore_errors=True)
        super().run()


setup(cmdclass={"build_py": CleanBuildPy})
