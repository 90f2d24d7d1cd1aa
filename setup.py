"""Builds the ctpu device's C++ extension (csrc/ctpu) at install; all other metadata is in pyproject.toml.

`pip install -e .` (and a wheel build) compile it with torch's cpp_extension against the pinned torch, which
the build environment gets from pyproject.toml's [build-system] requires.
"""

from glob import glob

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "torch_tpu_backend.device._C",
            sources=sorted(glob("csrc/ctpu/*.cpp")),
            include_dirs=["csrc/ctpu"],
            extra_compile_args=["-O2"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
