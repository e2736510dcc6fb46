# The course's commands. `make lab` opens the course, `make test` checks everything.
# Both create the virtual environment first if it is missing.

PYTHON ?= python3
VENV ?= .venv
# The PyTorch build to install. The default is the CPU build on this course's
# reference machine; on a GPU machine the same pin from PyPI is a CUDA build, or
# pass another, e.g. make lab TORCH="torch==2.13.0 --index-url <your wheel index>".
TORCH ?= torch==2.13.0
LAB_ARGS ?=
# The folder JupyterLab opens: the full course, or e.g. dist/student after make student.
LAB_ROOT ?= notebooks
# Jupyter refuses to run as root unless told; containers and CI often are root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

BIN := $(VENV)/bin
STAMP := $(VENV)/.labkit-installed
GRADING := $(VENV)/.labkit-grading

.PHONY: setup lab course test check lint unit notebooks check-notebooks nbval executed student site site-check nbgrader nbgrader-check ecosystem-check clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and alone, so that the extras below never pull another build.
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

# nbgrader, for make nbgrader and its check only (see pyproject.toml's grading extra).
$(GRADING): $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[grading]"
	touch $@

## Set up .venv only (what make lab does first); the dev container runs it.
setup: $(STAMP)

## Open the course in JupyterLab (listens on 127.0.0.1 only), with the course's
## defaults for its settings (jupyterlab-settings/overrides.json5).
lab: $(STAMP)
	$(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=$(LAB_ROOT) --LabApp.app_settings_dir=$(CURDIR)/jupyterlab-settings $(ROOT_FLAG) $(LAB_ARGS)

## Execute every notebook of both languages headless (tools/execute.py, as
## JupyterLab runs it: in its folder, its kernel); goes on past a failing one
## and fails at the end.
course: $(STAMP)
	$(BIN)/python tools/execute.py notebooks/ja/*.ipynb notebooks/en/*.ipynb

## Write notebooks/ja and notebooks/en from course/.
notebooks: $(STAMP)
	$(BIN)/python tools/build_notebooks.py

check-notebooks: $(STAMP)
	$(BIN)/python tools/build_notebooks.py --check

lint: $(STAMP)
	$(BIN)/ruff check labkit tests tools bench course website

unit: $(STAMP)
	$(BIN)/python -m pytest -rs tests

## Every lesson of both languages run by nbval, once: a cell that raises fails, and
## so does a cell tagged raises-exception that no longer raises, or a process left
## after a lesson. Each lesson as it ran is kept in build/executed/ (the site shows
## those runs); the end of the output lists the kernels started per notebook.
nbval: $(STAMP)
	PYTHONPATH=tools $(BIN)/python -m pytest -p nbval_record --nbval-lax --nbval-current-env --nbval-cell-timeout=300 notebooks/ja notebooks/en

## Run (with nbval, as above) only the lessons whose copy in build/executed/ is
## missing, failed, or stale: their notebook, labkit, the packages or Python changed.
executed: $(STAMP)
	$(BIN)/python tools/executed.py

## Student copies of every lesson, without solution cells: dist/student/ja and en.
student: $(STAMP)
	$(BIN)/python tools/student_copies.py

## The course as a website in build/site (open build/site/index.html): both
## languages, each lesson as nbval last ran it (build/executed; make executed first
## runs the lessons whose run is missing or stale), the labkit reference; any Sphinx
## warning fails the build. Each language builds in build/sphinx/<lang>, then both
## are put together in build/site.
site: $(STAMP) student executed
	for lang in ja en; do \
	    $(BIN)/sphinx-build -W --keep-going -q -b html -d build/sphinx/$$lang/doctrees website/$$lang build/sphinx/$$lang/html \
	    && rm -rf build/site/$$lang && mkdir -p build/site \
	    && cp -r build/sphinx/$$lang/html build/site/$$lang || exit 1; \
	done
	cp website/index.html build/site/index.html

## The built site checked: links, anchors, figures, twins, and in a browser.
site-check: site
	LABKIT_SITE=build/site $(BIN)/python -m pytest tests/test_site.py

## The course for nbgrader in build/nbgrader (or NBGRADER_OUT=folder): each lesson
## with exercises, in each language, an assignment (source/ with the solutions,
## release/ without).
NBGRADER_OUT ?= build/nbgrader
nbgrader: $(GRADING)
	$(BIN)/python tools/nbgrader_course.py --out $(NBGRADER_OUT)

## nbgrader's round trip on a sample (tests/test_nbgrader.py's SAMPLE: lessons 02 in
## Japanese and 06 in English): validate, autograde (full marks for the reference
## answers, a typical mistake losing its points), feedback with the hint.
nbgrader-check: $(GRADING)
	LABKIT_NBGRADER=1 $(BIN)/python -m pytest tests/test_nbgrader.py

## The same round trip on every assignment, a mistake in each lesson (about half
## an hour here); CI runs it weekly (.github/workflows/nbgrader.yml).
.PHONY: nbgrader-check-all
nbgrader-check-all: $(GRADING)
	LABKIT_NBGRADER=all $(BIN)/python -m pytest tests/test_nbgrader.py

## Lesson 09's optional frameworks (pyproject's ecosystem extra: Lightning and
## Accelerate), checked where they are installed: the sections the errata's rows
## link to that assert only with the extra run, and must assert
## (LABKIT_REQUIRE_ECOSYSTEM=1 makes a missing framework a failure). The extra goes
## into a venv of its own, build/ecosystem-venv, that sees .venv's packages (a .pth
## file): the same torch and labkit, and .venv stays as a learner's, so the lesson
## runs kept in build/executed stay fresh. About a minute here, the first time.
ECO_VENV := build/ecosystem-venv
ECO_STAMP := $(ECO_VENV)/.labkit-installed
PURELIB := import sysconfig; print(sysconfig.get_paths()["purelib"])

$(ECO_STAMP): pyproject.toml $(STAMP)
	test -x $(ECO_VENV)/bin/python || $(BIN)/python -m venv $(ECO_VENV)
	echo "$$($(BIN)/python -c '$(PURELIB)')" > "$$($(ECO_VENV)/bin/python -c '$(PURELIB)')/labkit-venv.pth"
	$(ECO_VENV)/bin/python -m pip install --quiet -e ".[ecosystem]"
	touch $@

ecosystem-check: $(ECO_STAMP)
	LABKIT_REQUIRE_ECOSYSTEM=1 $(ECO_VENV)/bin/python -m pytest -rs \
	    tests/test_claims_ledger.py::test_sections_asserted_only_with_the_ecosystem_extra_assert_there \
	    tests/test_scaleout.py::test_frameworks_call_no_sync_where_they_accumulate

## Everything CI checks, step by step; each step's time is printed as it ends,
## and all of them at the end (also in build/test-times.txt).
TEST_STEPS := lint check-notebooks unit ecosystem-check nbval site-check nbgrader-check
test: $(STAMP)
	@mkdir -p build && : > build/test-times.txt; \
	for step in $(TEST_STEPS); do \
	    start=$$(date +%s); \
	    $(MAKE) --no-print-directory $$step; status=$$?; \
	    took="make test: $$step $$( [ $$status = 0 ] || echo FAILED ) in $$(( $$(date +%s) - start )) s"; \
	    echo "$$took" >> build/test-times.txt; echo "$$took"; \
	    [ $$status = 0 ] || { cat build/test-times.txt; exit $$status; }; \
	done; \
	echo "make test: every step passed"; cat build/test-times.txt

## The quick check for contributors (about two minutes): lint, the notebooks in
## sync with course/, and the unit tests that start no process.
check: $(STAMP)
	$(BIN)/ruff check labkit tests tools bench course website
	$(BIN)/python tools/build_notebooks.py --check
	$(BIN)/python -m pytest -q -m "not procs" tests

clean-venv:
	rm -rf $(VENV)
