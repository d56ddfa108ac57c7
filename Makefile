# Two commands do everything on a fresh machine:
#   make lab    JupyterLab on the quick-start notebook
#   make test   install everything the tests need and run the whole suite (what CI runs)
.PHONY: help lab test bench notebooks

# extra arguments for `jupyter lab` (make lab LAB_ARGS="--no-browser --port 9999")
LAB_ARGS ?=

help:  ## list the targets
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

lab:  ## JupyterLab on notebooks/00_quick_start.ipynb (creates .venv on first use; LAB_ARGS="--port 9999")
	bash scripts/lab.sh $(LAB_ARGS)

test:  ## install test dependencies and run every test stage
	bash scripts/test.sh

bench:  ## print the speed benchmarks
	. .venv/bin/activate && python benchmarks/bench_estimate.py && python benchmarks/bench_planner.py \
	  && python benchmarks/bench_widgets.py && python benchmarks/bench_measure.py --quick

notebooks:  ## re-execute the notebooks in place after a deliberate change to the numbers
	. .venv/bin/activate && python scripts/refresh_notebooks.py
