# Setup and the two entry points of the README. Everything installs into ./.venv with pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo serve-demo test bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch first and pinned: served from this machine's disk; a plain "torch" would download a new build
	$(BIN)/pip install torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: install  # trains 576 steps of 256 images: about 4 minutes on 2 CPU cores (install excluded)
	$(BIN)/moco demo --out demo --no-serve

serve-demo: install  # the web app and JSON API over the demo's index, at http://127.0.0.1:7860/
	$(BIN)/moco serve demo/index

test: install  # the linter and the formatter first (seconds), then the suite
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest

bench: install
	$(BIN)/python bench/train_throughput.py --arch resnet18 --image-size 32 --batch-size 128 --device cpu

clean:
	rm -rf $(VENV) demo  # bench/results holds committed measurements: never removed here
