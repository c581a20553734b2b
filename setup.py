"""The metadata is in setup.cfg; this file only adds ``_dask_chainer_pipeline_hook.pth`` to what
is installed, at the root of site-packages, for a regular install (``build_py`` copies it beside
the packages in the wheel) and for ``pip install -e .`` (``editable_wheel`` adds it to the
editable wheel, which holds no package files). Python runs the line at start: it makes a plain
``import chainer`` work on NumPy 2 (``_dask_chainer_pipeline_hook.py``)."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "_dask_chainer_pipeline_hook.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, str(Path(self.build_lib, PTH)), preserve_mode=False)


class EditableWheelWithPth(editable_wheel):
    # editable_wheel writes only its own finder and .pth into the wheel (setuptools 64-80).
    def _create_wheel_file(self, bdist_wheel):
        from wheel.wheelfile import WheelFile
        wheel_path = super()._create_wheel_file(bdist_wheel)
        with WheelFile(wheel_path, "a") as wheel:
            wheel.write(PTH, PTH)
        return wheel_path


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
