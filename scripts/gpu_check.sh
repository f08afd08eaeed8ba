#!/usr/bin/env bash
# GPU check of the HF engine on one CUDA GPU, in under 10 minutes, with no vLLM and no network:
#   1. scripts/hf_device_check.py: the HF engine's supervision on CUDA equals the CPU result (fp32 to float
#      rounding, bf16 within bf16 agreement), one JSON line per dtype;
#   2. scripts/staging_device_check.py: answers reach pinned host memory off the engine's stream, equal to
#      .cpu(), with pinned blocks reused; one JSON line;
#   3. bench/server.py --device cuda: the real server serves every format from the GPU; prints its JSON.
# It runs on that machine's own python and torch. The packages it lacks are installed into a throw-away venv
# (which sees the system's packages, torch included) from wheels prepared beforehand on a machine with PyPI:
#
#   scripts/gpu_check.sh --prepare [PYTHON_VERSION]   # here: download the pinned wheels to .cache/gpu-wheels
#   scripts/gpu_check.sh                              # there: install them offline and run the checks
#
# WHEELS (default .cache/gpu-wheels) and PYTHON (default python3) override the locations.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.cache/gpu-wheels}

if [[ ${1:-} == --prepare ]]; then
  python_version=${2:-3.12}
  mkdir -p "$WHEELS"
  # pyproject.toml's core and server pins plus httpx (bench/server.py's client), except torch: the GPU
  # machine's own torch is used.
  "$PYTHON" - >"$WHEELS/requirements.txt" <<'EOF'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
for requirement in dict.fromkeys(project["dependencies"] + extras["server"] + extras["client"]):
    name = re.split(r"[<>=!~ \[]", requirement)[0]
    if name != "torch" and (requirement not in extras["client"] or name == "httpx"):
        print(requirement)
EOF
  "$PYTHON" -m pip download --quiet --dest "$WHEELS" --only-binary=:all: --python-version "$python_version" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -r "$WHEELS/requirements.txt"
  du -sh "$WHEELS"
  exit 0
fi

if [[ ! -f $WHEELS/requirements.txt ]]; then
  echo "no prepared wheels in $WHEELS: run scripts/gpu_check.sh --prepare on a machine with PyPI" >&2
  exit 2
fi
"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible to torch")'
venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
"$PYTHON" -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet --no-index --find-links "$WHEELS" -r "$WHEELS/requirements.txt"
export PYTHONPATH="$PWD/image:$PWD/operator:$PWD${PYTHONPATH:+:$PYTHONPATH}"

status=0
timeout 300 "$venv/bin/python" scripts/hf_device_check.py --device cuda || status=1
timeout 120 "$venv/bin/python" scripts/staging_device_check.py --device cuda || status=1
timeout 240 "$venv/bin/python" -m bench.server --device cuda --rounds 2 || status=1
exit $status
