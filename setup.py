"""Builds the one optional C extension (``hvd_magic/collectives/backends/_stream.c``); all
other metadata is in pyproject.toml. Without a C compiler the install still succeeds and the
runtime does without streaming copies."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("hvd_magic.collectives.backends._stream",
                             ["hvd_magic/collectives/backends/_stream.c"], optional=True)])
