# cffi modules must be declared through setup(); everything else lives in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["native/build_native.py:ffibuilder"])
