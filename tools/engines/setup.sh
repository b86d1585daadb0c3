#!/usr/bin/env bash
# The vLLM venv that the engine test tier (tests/engines, `make test-engines`) and
# bench/engines.py run in: vLLM pinned, DCR installed editable from this checkout.
#
# vLLM ships a CUDA wheel with its own torch and transformers, which clash with the
# project venv's, so it lives in its own venv, cached outside the repo:
#   ${DCR_ENGINES_CACHE:-~/.cache/dcr-engines}/vllm-<version>
# The first run takes 7-15 min and ~9.4 GB (the vLLM wheel and its CUDA packages);
# later runs take seconds: each step checks whether it is already done. The last line
# printed is the venv's python, for callers that capture it.
#
# Environment: DCR_VLLM_VERSION (default 0.33.0: the version the tests were written
# against), DCR_ENGINES_PYTHON (default python3.11; vLLM 0.33 supports 3.10-3.13),
# DCR_ENGINES_CACHE (default ~/.cache/dcr-engines).
set -euo pipefail

VLLM_VERSION="${DCR_VLLM_VERSION:-0.33.0}"
PYTHON="${DCR_ENGINES_PYTHON:-python3.11}"
CACHE="${DCR_ENGINES_CACHE:-$HOME/.cache/dcr-engines}"
VENV="$CACHE/vllm-$VLLM_VERSION"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VPY="$VENV/bin/python"
# What `import dcr.apply.applier, dcr.owner.diff, dcr.runtimes.vllm` needs beyond vLLM's
# own dependencies (numpy, pydantic, aiohttp, tqdm, safetensors, transformers), and the
# test runner.
DEPS=(numpy zstandard xxhash pydantic aiohttp tqdm boto3 safetensors pytest pytest-timeout)

say() { printf 'tools/engines/setup.sh: %s\n' "$*" >&2; }

if [[ ! -x "$VPY" ]]; then
    say "creating $VENV with $PYTHON"
    mkdir -p "$CACHE"
    "$PYTHON" -m venv "$VENV"
    "$VPY" -m pip install --quiet --upgrade pip
fi

installed() { "$VPY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }

if [[ "$(installed vllm)" != "$VLLM_VERSION" ]]; then
    say "installing vllm==$VLLM_VERSION into $VENV (7-15 min and ~9.4 GB the first time)"
    "$VPY" -m pip install --progress-bar on "vllm==$VLLM_VERSION" >&2
else
    say "vllm $VLLM_VERSION already installed"
fi

missing=()
for dep in "${DEPS[@]}"; do
    [[ -n "$(installed "$dep")" ]] || missing+=("$dep")
done
if ((${#missing[@]})); then
    say "installing DCR's runtime dependencies and pytest: ${missing[*]}"
    # Only what is missing: an installed package (vLLM's numpy, pydantic, ...) is kept
    # at the version vLLM chose.
    "$VPY" -m pip install --quiet "${missing[@]}" >&2
fi

# DCR, editable from this checkout (no dependencies: vLLM's torch and transformers stay).
where="$("$VPY" -c 'import dcr, pathlib; print(pathlib.Path(dcr.__file__).resolve().parent)' \
    2>/dev/null || true)"
if [[ "$where" != "$REPO/agent/dcr" ]] || ! "$VPY" -c 'import dcr.codec._native' 2>/dev/null; then
    say "installing DCR editable from $REPO (builds the codec's C extension)"
    "$VPY" -m pip install --quiet --no-deps --no-build-isolation -e "$REPO" >&2
fi

say "checking that vLLM and DCR import"
"$VPY" -c 'import dcr.apply.applier, dcr.owner.diff, dcr.runtimes.vllm' >&2
VLLM_TARGET_DEVICE=cpu "$VPY" -c 'import vllm; print("vllm", vllm.__version__)' >&2
say "ready: $VENV"
echo "$VPY"
