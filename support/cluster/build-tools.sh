#!/usr/bin/env bash
# Builds the local control plane's binaries from the pinned Go wrapper modules in tools/, and kube-score.
#
# Each binary is stored once per content key (its module files + flags) in the user cache and linked into
# .cache/bin/, so a pin change rebuilds only what changed and a fresh clone reuses earlier builds.
# Go's module and build caches stay in the user cache too; GOTOOLCHAIN=local forbids toolchain downloads.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
store=${E3T_TOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/eagle3-target/bin}
bin="$repo/.cache/bin"
mkdir -p "$store" "$bin"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false
export GOMODCACHE=${GOMODCACHE:-$(go env GOMODCACHE)} GOCACHE=${GOCACHE:-$(go env GOCACHE)}

KUBE_VERSION=v1.36.3   # must match tools/kube/go.mod
HELM_VERSION=v3.22.0   # must match tools/helm/go.mod
minor=$(echo "$KUBE_VERSION" | cut -d. -f2)

kube_ldflags="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  kube_ldflags+=" -X $p.gitVersion=$KUBE_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
done
helm_ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for p in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  helm_ldflags+=" -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$minor"
done

# build NAME MODULE_DIR PACKAGE LDFLAGS [LINK...]: build once per key, then link NAME and LINKs into .cache/bin.
build() {
  local name=$1 dir=$2 pkg=$3 ldflags=$4; shift 4
  local key
  key=$( { cat "$here/tools/$dir"/go.{mod,sum}; find "$here/tools/$dir" -name '*.go' -exec cat {} +;
          echo "$ldflags $(go env GOVERSION)"; } | sha256sum | cut -c1-12)
  local out="$store/$name-$key"
  if [ -x "$out" ]; then
    echo "==> $name: cached ($out)"
  else
    echo "==> $name: building (cold builds take minutes; kube is the longest)"
    local start=$SECONDS
    (cd "$here/tools/$dir" && go build -trimpath -ldflags "$ldflags" -o "$out.tmp" "$pkg")
    mv "$out.tmp" "$out"
    echo "==> $name: built in $((SECONDS - start))s"
  fi
  for link in "$name" "$@"; do ln -sfn "$out" "$bin/$link"; done
}

# install NAME MODULE@VERSION: `go install` of a released command (its own go.sum pins its dependencies),
# stored once per version and Go toolchain in the same store.
install() {
  local name=$1 module=$2 key
  key=$(echo "$module -trimpath -s -w $(go env GOVERSION)" | sha256sum | cut -c1-12)
  local out="$store/$name-$key"
  if [ -x "$out" ]; then
    echo "==> $name: cached ($out)"
  else
    echo "==> $name: building $module"
    local start=$SECONDS gobin
    gobin=$(mktemp -d)
    GOBIN=$gobin go install -trimpath -ldflags "-s -w" "$module"
    mv "$gobin/$name" "$out" && rmdir "$gobin"
    echo "==> $name: built in $((SECONDS - start))s"
  fi
  ln -sfn "$out" "$bin/$name"
}

build etcd etcd go.etcd.io/etcd/server/v3 "-s -w"
build kwok kwok sigs.k8s.io/kwok/cmd/kwok "-s -w"
build helm helm helm.sh/helm/v3/cmd/helm "$helm_ldflags"
build kube kube . "$kube_ldflags" kube-apiserver kube-controller-manager kube-scheduler kubectl
# The manifest linter the chart and rendered-target tests run (tests/charts/test_kube_score.py).
install kube-score github.com/zegl/kube-score/cmd/kube-score@v1.20.0
echo "==> tools ready in $bin"
