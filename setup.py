"""Packaging beyond pyproject.toml: `moe_place_sglang.pth` at the top of site-packages.

Python runs a `.pth` file's `import` lines at the start of every process, and only from the top of
site-packages; the file (one line, which does nothing unless `MOE_PLACE_SGLANG` is set: see
`moe_place/engines/sglang_startup.py`) is not a module, so `build_py` copies it there: into the
build folder for a wheel (whose top is site-packages), and for an editable install (PEP 660) into
the editable wheel itself, the folder setuptools installs into site-packages.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "moe_place_sglang.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        target = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        self.copy_file(str(Path(__file__).resolve().parent / PTH), str(Path(target) / PTH))

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
