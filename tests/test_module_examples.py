"""Every example in a module docstring of the package runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import trainmem_nb

MODULES = sorted(m.name for m in pkgutil.walk_packages(trainmem_nb.__path__, "trainmem_nb."))


@pytest.mark.parametrize("name", MODULES)
def test_module_examples_print_what_they_say(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} fail"
