# cffi modules and C extensions must be declared through setup(); everything else lives in
# pyproject.toml. memsem._native: cffi (native/build_native.py). memsem._hot: the hot path's
# entry, a plain CPython extension (native/memsem_hot.c) over the same memsem_native.c.
from setuptools import Extension, setup

hot = Extension(
    "memsem._hot",
    sources=["native/memsem_hot.c", "native/memsem_native.c"],
    include_dirs=["native"],
    extra_compile_args=["-O2", "-std=gnu11"],
)

setup(cffi_modules=["native/build_native.py:ffibuilder"], ext_modules=[hot])
