"""The native CPU kernels (``specjax/kernels/*.cc``) build with the package:
``pip install .``, a wheel, ``pip install git+URL`` and the editable install
of ``make`` all compile them for the machine that builds. They form one
plain shared library, ``specjax/kernels/_native.so``, that
``specjax.kernels.native`` loads with ctypes and registers with XLA; it is
compiled against jaxlib's FFI headers (jaxlib is a build requirement,
pyproject.toml). The kernels choose AVX-512, AVX2 + FMA or plain C++ when
they run, so the library needs no -march; Python's own -g and -fwrapv are
overridden. A compiler error does not fail the install: specjax then says
once that the kernels are off and runs XLA's ops."""

import importlib.util
import pathlib

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNELS = "specjax/kernels"


class BuildKernels(build_ext):
  """``build_ext`` for a library that is not a Python module: jaxlib's FFI
  headers on the include path, and the file named ``_native.so`` (no
  Python ABI tag: it has no module init, and ``native.LIBRARY`` names
  it)."""

  def build_extensions(self):
    jaxlib = importlib.util.find_spec("jaxlib")
    if jaxlib is None:
      raise RuntimeError("the kernels build against jaxlib's FFI headers: "
                         "install jaxlib first")
    include = pathlib.Path(jaxlib.submodule_search_locations[0]) / "include"
    for ext in self.extensions:
      ext.include_dirs.append(str(include))
    super().build_extensions()

  def get_ext_filename(self, fullname):
    return str(pathlib.Path(*fullname.split("."))) + ".so"


setup(
    ext_modules=[Extension(
        "specjax.kernels._native",
        sources=[f"{KERNELS}/small_gemm.cc", f"{KERNELS}/attention.cc"],
        depends=[f"{KERNELS}/common.h"],
        language="c++",
        extra_compile_args=["-O3", "-g0", "-fno-wrapv", "-fno-trapping-math",
                            "-std=c++17"],
        optional=True)],
    cmdclass={"build_ext": BuildKernels})
