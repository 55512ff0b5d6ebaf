"""Install-time build of the CPU kernels (specpack/runtime/kernels/*.c) into one shared library,
`specpack/runtime/kernels/_native*.so`, which kernels/_lib.py loads through ctypes: a machine
without a C compiler at run time still gets the kernels. The build is optional: where it cannot
run (no compiler, not x86-64 Linux) the install goes on, and the kernels compile on first use or
torch's path runs. Everything else about the package is in pyproject.toml."""

import importlib.util
import platform
import sys
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent


def _kernels_lib():
    """kernels/_lib.py (sources, flags, source hash) without importing the package (or torch)."""
    spec = importlib.util.spec_from_file_location("_specpack_kernels_lib", HERE / "specpack/runtime/kernels/_lib.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernels() -> list[Extension]:
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    lib = _kernels_lib()
    return [Extension(
        f"specpack.runtime.kernels.{lib.PREBUILT}",
        sources=[str(p.relative_to(HERE)) for p in lib.SOURCES],
        depends=[str(p.relative_to(HERE)) for p in lib.HEADERS],
        extra_compile_args=lib.COMPILE_FLAGS,
        extra_link_args=["-pthread"],
        define_macros=[("SP_SOURCE_HASH", f'"{lib.source_hash()}"')],
        optional=True,  # a failed build is a warning, not a failed install
    )]


setup(ext_modules=kernels())
