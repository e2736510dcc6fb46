# The course's commands. `make lab` opens the course, `make test` checks everything.
# Both create the virtual environment first if it is missing (lab with what a learner
# needs, test with the checks' tools too). Each target runs the step of the same name
# in tools/course.py, which is where the steps are written (the same commands without
# make, on Linux, macOS and Windows: README).

PYTHON ?= python3
VENV ?= .venv
# The PyTorch build to install first; empty: tools/course.py's (on Linux without an
# NVIDIA driver the CPU build, elsewhere the pin from PyPI, a CUDA build on Linux),
# or pass another, e.g.
# make lab TORCH="torch==2.13.0 --index-url <your wheel index>".
TORCH ?=
LAB_ARGS ?=
# The folder JupyterLab opens: the full course, or e.g. dist/student after make student.
LAB_ROOT ?= notebooks
NBGRADER_OUT ?= build/nbgrader

COURSE := $(PYTHON) tools/course.py --venv "$(VENV)" $(if $(TORCH),--torch "$(TORCH)")

STEPS := setup course notebooks check-notebooks lint unit nbval executed student site \
    site-check nbgrader-check nbgrader-check-all ecosystem-check test check lock clean-venv
.PHONY: $(STEPS) lab nbgrader

## setup: only .venv, from the lock (torch first, then constraints.txt's pins), with
##   the tools make test uses (pyproject's dev extra); CI runs it first.
## course: every notebook executed headless (tools/execute.py, as JupyterLab
##   runs it); goes on past a failing one and fails at the end.
## nbval: every lesson of both languages run by nbval, once: a cell that raises
##   fails, and so does a cell tagged raises-exception that no longer raises, or a
##   process left after a lesson; each run is kept in build/executed/.
## executed: nbval on the lessons whose kept run is missing, failed or stale.
## site: the course as a website in build/site; site-check: built, then checked.
## nbgrader-check: nbgrader's round trip on a sample; -all: on every assignment
##   (about half an hour here; CI runs it weekly, .github/workflows/nbgrader.yml).
## ecosystem-check: lesson 09's Lightning and Accelerate cells in build/ecosystem-venv.
## test: lint check-notebooks unit ecosystem-check nbval site-check nbgrader-check,
##   each step's time printed as it ends and all at the end (build/test-times.txt).
## check: the quick check (about two minutes): lint, notebooks in sync, the unit
##   tests that start no process.
## lock: refresh constraints.txt from pyproject.toml.
$(STEPS):
	$(COURSE) $@

## Open the course in JupyterLab (listens on 127.0.0.1 only).
lab:
	$(COURSE) lab --root "$(LAB_ROOT)" -- $(LAB_ARGS)

## The course for nbgrader in build/nbgrader (or NBGRADER_OUT=folder).
nbgrader:
	$(COURSE) nbgrader --out "$(NBGRADER_OUT)"
