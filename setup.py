"""Packaging for colossalai-cmap.

Besides the package, the install ships ``colossalai_cmap.pth`` into site-packages so that ``from colossalai import
cmap`` works with no other import. The custom commands put the file into regular wheels (``pip install .``) and into
editable wheels (``pip install -e .``).
"""

import os
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # pragma: no cover - setuptools < 64
    editable_wheel = None

HERE = Path(__file__).parent
PTH = "colossalai_cmap.pth"


class BuildPyWithPth(build_py):
    """Copies the start-up hook next to the package in the build tree, so the wheel installs it."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(HERE / PTH), os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode: bool = True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


cmdclass = {"build_py": BuildPyWithPth}

if editable_wheel is not None:

    class EditableWheelWithPth(editable_wheel):
        """Adds the start-up hook to the editable wheel, next to setuptools' own path hook."""

        def _create_wheel_file(self, bdist_wheel):  # noqa: ANN001
            from wheel.wheelfile import WheelFile

            wheel_path = super()._create_wheel_file(bdist_wheel)
            with WheelFile(wheel_path, "a") as wheel:
                wheel.write(str(HERE / PTH), PTH)
            return wheel_path

    cmdclass["editable_wheel"] = EditableWheelWithPth


# The reference the collectives are checked against (tests/test_parity.py); jax 0.10 needs Python 3.11.
JAX = "jax[cpu]==0.10.2; python_version >= '3.11'"


def read_requirements(name: str):
    return [
        line.strip() for line in (HERE / name).read_text().splitlines() if line.strip() and not line.startswith("#")
    ]


setup(
    name="colossalai-cmap",
    version="0.1.0",
    description="jax.pmap for PyTorch on Colossal-AI: vmap a function across the processes of a group",
    long_description=(HERE / "README.md").read_text() if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["colossalai_cmap", "colossalai_cmap.*"]),
    python_requires=">=3.8",
    install_requires=read_requirements("requirements.txt"),
    extras_require={
        "test": ["pytest>=7", "pytest-xdist>=3", "pytest-timeout>=2", "hypothesis>=6", "psutil", "wheel", JAX],
        "parity": [JAX],
        "bench": ["matplotlib"],
        "dev": ["black", "isort"],
    },
    cmdclass=cmdclass,
    zip_safe=False,
)
