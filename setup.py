"""The one part of the build pyproject.toml cannot declare yet without an experimental table: the caching
allocator's default path in C (trainmem_nb/engine/allocator/_fastreplay.c, the Python C API only). It is
optional: where no C compiler is found the install still succeeds and the allocator replays in Python
(the same bytes, about twenty times slower; `trainmem_nb.engine.allocator.fast.NATIVE` says which)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("trainmem_nb.engine.allocator._fastreplay",
                             ["trainmem_nb/engine/allocator/_fastreplay.c"], optional=True)])
