# The two quickstart commands: `make demo` and `make test`. Each builds .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO := demo-out
PIP := $(BIN)/pip install -q --disable-pip-version-check

.PHONY: venv demo test test-slow bench clean docs docs-check

venv: $(STAMP)

# megatron-core 0.19.2 (the newest; a Python 3.12 wheel, pure Python where the Megatron
# fixtures use it) runs beside 0.16.1 from its own folder on PYTHONPATH, with triton, which it
# imports: tests/fixtures_megatron.py writes the common_state / integrity.json layout with it.
MEGATRON_NEXT := $(VENV)/megatron-core-0.19.2
# torchtitan 0.3.0's checkpointer (tests/fixtures/load_with_torchtitan.py) with what it imports,
# in a folder of its own: torchtitan's own requirements pull wandb, tensorboard and datasets
TORCHTITAN := $(VENV)/torchtitan-0.3.0
# Debian's Chromium, which playwright drives for the report's browser test and the README's
# picture of a report (tests/browser.py; playwright downloads no browser). Installed as root
# when missing (a failed install fails the setup); without root, a note, and the browser
# tests skip with the reason.
CHROMIUM := /usr/bin/chromium

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(PIP) -e '.[dev]'
	$(PIP) --no-deps --target $(MEGATRON_NEXT) --upgrade triton==3.6.0
	$(PIP) --no-deps --target $(MEGATRON_NEXT) --upgrade --only-binary=:all: \
	    --python-version 3.12 --ignore-requires-python megatron-core==0.19.2
	$(PIP) --no-deps --target $(TORCHTITAN) --upgrade torchtitan==0.3.0 tyro==1.0.17 \
	    docstring_parser==0.18.0 typeguard==4.6.1 spmd_types==0.2.3
	# Azurite (npm), the Azure Blob tests' loopback server (tests/cloudservers.py), in its own folder
	npm install --prefix $(VENV)/azurite --no-audit --no-fund --loglevel=error azurite@3.37.0
	@if [ ! -x $(CHROMIUM) ]; then \
	    if [ "$$(id -u)" = 0 ]; then \
	        echo "apt-get install chromium (for the browser tests)"; \
	        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	            --no-install-recommends chromium > /dev/null && test -x $(CHROMIUM); \
	    else \
	        echo "note: no $(CHROMIUM) and not root: the browser tests will skip (apt-get install chromium)"; \
	    fi; \
	fi
	$(BIN)/python -c "import ckptctl, torch, s3fs, safetensors, moto, hypothesis, transformers, accelerate, lightning, peft"
	touch $(STAMP)

demo: venv
	@echo "== writing a real checkpoint: torchrun, FSDP2 on 4 CPU ranks (gloo), Adam state"
	rm -rf $(DEMO) && mkdir -p $(DEMO) && $(BIN)/python -m torch.distributed.run --standalone \
	    --nproc_per_node=4 tests/fixtures/write_dcp.py --layout fsdp --out $(DEMO)/tmp \
	    > $(DEMO)/torchrun.log 2>&1 || { cat $(DEMO)/torchrun.log; exit 1; }
	mkdir -p $(DEMO)/run1 && mv $(DEMO)/tmp/fsdp/step-* $(DEMO)/run1/ && rm -rf $(DEMO)/tmp
	$(BIN)/ckptctl ls $(DEMO)/run1
	$(BIN)/ckptctl inspect $(DEMO)/run1/step-20
	$(BIN)/ckptctl inspect $(DEMO)/run1/step-20 --tree --filter 'model.layers.0.*'
	$(BIN)/ckptctl seal $(DEMO)/run1/step-20 --tag demo
	$(BIN)/ckptctl verify $(DEMO)/run1/step-20 --level full --check-finite --require model,optim,step
	$(BIN)/ckptctl reshard $(DEMO)/run1/step-20 $(DEMO)/run1-2d/step-20 --mesh dp=2,tp=2 --rules llama --dry-run
	$(BIN)/ckptctl reshard $(DEMO)/run1/step-20 $(DEMO)/run1-2d/step-20 --mesh dp=2,tp=2 --rules llama
	$(BIN)/ckptctl consolidate $(DEMO)/run1/step-20 $(DEMO)/hf --to safetensors --only model --strip-prefix model. --dtype bf16
	@echo "== tiers: promote to a second place (verified, committed last), then retention"
	$(BIN)/ckptctl promote $(DEMO)/run1/step-20 $(DEMO)/warm/step-20 --dry-run
	$(BIN)/ckptctl promote $(DEMO)/run1/step-20 $(DEMO)/warm/step-20 --bwlimit 500MiB/s
	$(BIN)/ckptctl verify $(DEMO)/warm/step-20 --level full
	$(BIN)/ckptctl latest $(DEMO)/warm
	$(BIN)/ckptctl gc $(DEMO)/run1 --keep-last 1 --dry-run
	@echo "== compare and compress: the reshard holds the same tensors; a lossless pack, read in place"
	$(BIN)/ckptctl diff $(DEMO)/run1/step-20 $(DEMO)/run1-2d/step-20
	$(BIN)/ckptctl pack $(DEMO)/run1/step-20 $(DEMO)/cold/step-20
	$(BIN)/ckptctl inspect $(DEMO)/cold/step-20
	$(BIN)/ckptctl verify $(DEMO)/cold/step-20 --level full
	$(BIN)/ckptctl unpack $(DEMO)/cold/step-20 $(DEMO)/restored/step-20
	$(BIN)/ckptctl diff $(DEMO)/run1/step-20 $(DEMO)/restored/step-20
	$(BIN)/ckptctl ls $(DEMO)
	@echo "== watch: training saves to hot while watch drains hot -> warm -> cold (loopback S3, packs) and trims each tier"
	$(BIN)/python tests/fixtures/watch_demo.py $(DEMO)/watch

test: venv
	$(BIN)/python -m pytest -n 2 -q

test-slow: venv
	$(BIN)/python -m pytest -q -m slow || [ $$? -eq 5 ]  # 5: none marked slow

bench: venv
	$(PIP) -e '.[dev,bench]'
	$(BIN)/python bench/verify_bench.py
	$(BIN)/python bench/consolidate_bench.py
	$(BIN)/python bench/exact_bench.py
	$(BIN)/python bench/deepspeed_bench.py
	$(BIN)/python bench/promote_bench.py
	$(BIN)/python bench/pack_bench.py

docs: venv
	$(BIN)/python tests/docsgen.py
	$(BIN)/python tests/readme_session.py
	$(BIN)/python tests/report_picture.py

docs-check: venv
	$(BIN)/python tests/docsgen.py --check

clean:
	rm -rf $(VENV) $(DEMO) tests/.cache
