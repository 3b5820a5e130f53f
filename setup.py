"""Build: the Python package; the native extension joins it in csrc/ (see README)."""
from setuptools import setup

setup()
