# Setup and the two entry points of the README. Everything installs into ./.venv with pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch first and pinned: served from this machine's disk; a plain "torch" would download a new build
	$(BIN)/pip install torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/moco demo --out demo

test: install
	$(BIN)/pytest

bench: install
	$(BIN)/python bench/train_throughput.py --arch resnet18 --image-size 32 64 --batch-size 128 --device cpu

clean:
	rm -rf $(VENV) demo  # bench/results holds committed measurements: never removed here
