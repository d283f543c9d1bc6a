"""The native loops of hicache, built at install: plain C shared libraries loaded with ctypes (tiers/native.py).

Everything else about the package is in pyproject.toml. An install that cannot compile them stops with a message
that says what is missing, instead of serving with the slower Python loops unknown to its operator.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = [
    Extension("tiers.l3._native_io", ["tiers/l3/native_io.c"], depends=["tiers/l3/copy_hash.h"],
              extra_compile_args=["-O2"]),
    Extension("hicache.replay._reuse_stack", ["hicache/replay/reuse_stack.c"], extra_compile_args=["-O2"]),
]


class BuildNative(build_ext):
    """build_ext whose failure names what is missing."""

    def get_export_symbols(self, ext):
        return []  # plain C libraries: no PyInit_ entry point to export

    def run(self):
        try:
            super().run()
        except Exception as e:  # CompileError, a missing compiler (OSError / DistutilsExecError), ...
            raise SystemExit(
                f"hicache: building its native I/O loops failed: {e}\n"
                "They need a C compiler and the C library headers: on Debian or Ubuntu `apt-get install gcc "
                "libc6-dev`, on Fedora `dnf install gcc glibc-devel`, then install hicache again."
            ) from e


setup(ext_modules=NATIVE, cmdclass={"build_ext": BuildNative})
