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

.PHONY: setup lab course test lint unit notebooks check-notebooks nbval student site site-check nbgrader nbgrader-check clean-venv

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

## Execute every notebook of both languages headless; fails on any error.
course: $(STAMP)
	$(BIN)/jupyter execute --timeout=600 notebooks/ja/*.ipynb notebooks/en/*.ipynb

## Write notebooks/ja and notebooks/en from course/.
notebooks: $(STAMP)
	$(BIN)/python tools/build_notebooks.py

check-notebooks: $(STAMP)
	$(BIN)/python tools/build_notebooks.py --check

lint: $(STAMP)
	$(BIN)/ruff check labkit tests tools bench course website

unit: $(STAMP)
	$(BIN)/python -m pytest tests

nbval: $(STAMP)
	$(BIN)/python -m pytest --nbval-lax --nbval-current-env --nbval-cell-timeout=300 notebooks/ja notebooks/en

## Student copies of every lesson, without solution cells: dist/student/ja and en.
student: $(STAMP)
	$(BIN)/python tools/student_copies.py

## The course as a website in build/site (open build/site/index.html): both
## languages, every lesson executed (an unchanged lesson is taken from the cache in
## build/site-cache), the labkit reference; any Sphinx warning fails the build.
## Each language builds in build/sphinx/<lang> (myst-nb keeps the executed lessons
## beside its html/), then both are put together in build/site.
site: $(STAMP) student
	for lang in ja en; do \
	    $(BIN)/sphinx-build -W --keep-going -q -b html -d build/sphinx/$$lang/doctrees website/$$lang build/sphinx/$$lang/html \
	    && rm -rf build/site/$$lang && mkdir -p build/site \
	    && cp -r build/sphinx/$$lang/html build/site/$$lang || exit 1; \
	done
	cp website/index.html build/site/index.html

## The built site checked: links, anchors, figures, twins, and in a browser.
site-check: site
	LABKIT_SITE=build/site $(BIN)/python -m pytest tests/test_site.py

## The course for nbgrader in build/nbgrader: each lesson with exercises, in each
## language, an assignment (source/ with the solutions, release/ without).
nbgrader: $(GRADING)
	$(BIN)/python tools/nbgrader_course.py

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

## Everything CI checks.
test: lint unit check-notebooks nbval site-check nbgrader-check

clean-venv:
	rm -rf $(VENV)
