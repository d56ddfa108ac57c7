"""``python -m trainmem_nb``: the ``trainmem`` command line."""

from .cli.main import main

raise SystemExit(main())
