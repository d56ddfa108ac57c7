"""The ``trainmem`` command line."""
