#!/usr/bin/env bash
# Builds the local control plane's binaries from the pinned Go module in tools/ (one go.mod for all of them, so
# the packages they share, most of Kubernetes' client and API types among them, compile once), and kube-score.
#
#   support/cluster/build-tools.sh demo   # what `make demo` runs: etcd, kube (apiserver, controller-manager,
#                                         # scheduler, kubectl), kwok, helm
#   support/cluster/build-tools.sh test   # those and the tests' manifest linter, kube-score
#
# Each binary is stored once per content key (the module files + flags) in the user cache and linked into
# .cache/bin/, so a pin change rebuilds only what changed and a fresh clone reuses earlier builds. The missing
# binaries of the module are built by one `go build`. Go's module and build caches stay in the user cache too;
# GOTOOLCHAIN=local forbids toolchain downloads.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# A Go at least as new as tools/go.mod's, named with what to do where it is missing or older.
"$repo/scripts/check_prereqs.sh" go
store=${E3T_TOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/eagle3-target/bin}
bin="$repo/.cache/bin"
mkdir -p "$store" "$bin"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false
export GOMODCACHE=${GOMODCACHE:-$(go env GOMODCACHE)} GOCACHE=${GOCACHE:-$(go env GOCACHE)}

KUBE_VERSION=v1.36.3   # must match tools/go.mod
HELM_VERSION=v3.21.4   # must match tools/go.mod
minor=$(echo "$KUBE_VERSION" | cut -d. -f2)

# One set of flags for every binary: the linker skips -X for a package a binary does not hold.
ldflags="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $p.gitVersion=$KUBE_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
done
ldflags+=" -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for p in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  ldflags+=" -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$minor"
done

# Compiled without optimisation or inlining (-N -l) and without debug info: these are test tools, and a cold
# build of the four takes 3.7 minutes on 2 cores instead of 5.6 (an API call here is as fast; a kubectl
# run starts about 0.1 s later). GOGC=1600: the compiler collects garbage rarely (at most 1.8 GB each).
gcflags="all=-N -l -dwarf=false"
export GOGC=1600

# name -> package in tools/go.mod (the binary go build writes is named after the package's last element).
declare -A packages=(
  [etcd]=go.etcd.io/etcd/server/v3
  [kube]=./kube
  [kwok]=sigs.k8s.io/kwok/cmd/kwok
  [helm]=helm.sh/helm/v3/cmd/helm
)
declare -A links=([kube]="kube-apiserver kube-controller-manager kube-scheduler kubectl")
key=$( { cat "$here/tools"/go.{mod,sum}; find "$here/tools" -name '*.go' -exec cat {} +;
        echo "$gcflags $ldflags $(go env GOVERSION)"; } | sha256sum | cut -c1-12)

link() { # link NAME STORED: NAME and its links in .cache/bin
  for name in "$1" ${links[$1]:-}; do ln -sfn "$2" "$bin/$name"; done
}

# build_module NAME...: the named binaries of tools/go.mod, the missing ones in one `go build`.
build_module() {
  local missing=() name
  for name in "$@"; do
    if [ -x "$store/$name-$key" ]; then
      echo "==> $name: cached ($store/$name-$key)"
    else
      missing+=("$name")
    fi
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "==> go build ${missing[*]} (cold: a few minutes, most of it kube-apiserver)"
    local start=$SECONDS out pkgs=()
    # All modules at once, in parallel (go build alone fetches them one import level at a time: 38 s vs 8).
    (cd "$here/tools" && go mod download)
    echo "==> go modules: downloaded in $((SECONDS - start))s"
    out=$(mktemp -d "$store/build.XXXXXX")
    for name in "${missing[@]}"; do pkgs+=("${packages[$name]}"); done
    (cd "$here/tools" && go build -trimpath -gcflags "$gcflags" -ldflags "$ldflags" -o "$out/" "${pkgs[@]}")
    for name in "${missing[@]}"; do
      local built=${packages[$name]##*/}
      [ "$built" != v3 ] || built=server  # go.etcd.io/etcd/server/v3: a major-version suffix names no binary
      mv "$out/$built" "$store/$name-$key"
    done
    rmdir "$out"
    echo "==> go build ${missing[*]}: built in $((SECONDS - start))s"
  fi
  for name in "$@"; do link "$name" "$store/$name-$key"; done
}

# install NAME MODULE@VERSION: `go install` of a released command (its own go.sum pins its dependencies),
# stored once per version and Go toolchain in the same store.
install() {
  local name=$1 module=$2 stored
  stored="$store/$name-$(echo "$module -trimpath -s -w $(go env GOVERSION)" | sha256sum | cut -c1-12)"
  if [ -x "$stored" ]; then
    echo "==> $name: cached ($stored)"
  else
    echo "==> $name: building $module"
    local start=$SECONDS gobin
    gobin=$(mktemp -d)
    GOBIN=$gobin go install -trimpath -ldflags "-s -w" "$module"
    mv "$gobin/$name" "$stored" && rmdir "$gobin"
    echo "==> $name: built in $((SECONDS - start))s"
  fi
  ln -sfn "$stored" "$bin/$name"
}

case ${1:-test} in
  demo) build_module etcd kube kwok helm ;;
  test)
    build_module etcd kube kwok helm
    # The manifest linter the chart and rendered-target tests run (tests/charts/test_kube_score.py).
    install kube-score github.com/zegl/kube-score/cmd/kube-score@v1.20.0
    ;;
  *) echo "usage: $0 [demo|test]" >&2; exit 2 ;;
esac
echo "==> tools ready in $bin"
