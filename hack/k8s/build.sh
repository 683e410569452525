#!/usr/bin/env bash
# Builds the test control planes (the multi-call `kube` binary: kube-apiserver,
# kube-controller-manager, kube-scheduler, etcd, kubectl), kwok and metrics-server, at the
# versions pinned in versions.env, into a cache outside the repository keyed by
# version. A second run with the same versions builds nothing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/versions.env"
cache=${KUBESTRATA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubestrata}
kube_dir="$cache/kubernetes-$KUBERNETES_VERSION"
kwok_dir="$cache/kwok-$KWOK_VERSION"
metrics_server_dir="$cache/metrics-server-$METRICS_SERVER_VERSION"

die() { echo "hack/k8s/build.sh: $*" >&2; exit 1; }

command -v go >/dev/null 2>&1 ||
  die "the Go toolchain is missing: install Go 1.26 or newer (https://go.dev/doc/install) and put 'go' on PATH"
grep -qE "^(require )?[[:space:]]*k8s.io/kubernetes $KUBERNETES_VERSION\$" "$here/go.mod" ||
  die "go.mod does not require k8s.io/kubernetes $KUBERNETES_VERSION: run hack/k8s/gen-gomod.sh after changing versions.env"

build_kube() {
  [ -x "$kube_dir/kube" ] && return 0
  echo "building Kubernetes $KUBERNETES_VERSION control planes into $kube_dir (first time only, 10-25 min)"
  local minor=${KUBERNETES_VERSION#v1.}; minor=${minor%%.*}
  local pkg=k8s.io/component-base/version
  local tmp="$kube_dir.tmp"
  rm -rf "$tmp" && mkdir -p "$tmp"
  (cd "$here" && CGO_ENABLED=0 go build -trimpath -o "$tmp/kube" \
    -ldflags "-s -w -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean" \
    .) || die "building the Kubernetes control planes failed (see the go output above)"
  for name in kube-apiserver kube-controller-manager kube-scheduler etcd kubectl; do
    ln -sf kube "$tmp/$name"
  done
  rm -rf "$kube_dir" && mv "$tmp" "$kube_dir"
}

build_kwok() {
  [ -x "$kwok_dir/kwok" ] && [ -d "$kwok_dir/stages" ] && return 0
  echo "building kwok $KWOK_VERSION into $kwok_dir"
  local tmp="$kwok_dir.tmp"
  rm -rf "$tmp" && mkdir -p "$tmp/stages"
  CGO_ENABLED=0 GOBIN="$tmp" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" ||
    die "building kwok $KWOK_VERSION failed (see the go output above)"
  # kwok runs nothing without Stages; take the ones its release ships.
  local src
  src=$(go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [ -d "$src/kustomize/stage" ] || die "kwok $KWOK_VERSION module has no kustomize/stage directory"
  cp "$src"/kustomize/stage/node/fast/node-initialize.yaml \
     "$src"/kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
     "$src"/kustomize/stage/pod/fast/pod-ready.yaml \
     "$src"/kustomize/stage/pod/fast/pod-complete.yaml \
     "$src"/kustomize/stage/pod/fast/pod-delete.yaml \
     "$tmp/stages/" || die "kwok $KWOK_VERSION stage files not where expected under $src/kustomize/stage"
  chmod u+w "$tmp"/stages/*
  rm -rf "$kwok_dir" && mv "$tmp" "$kwok_dir"
}

build_metrics_server() {
  [ -x "$metrics_server_dir/metrics-server" ] && return 0
  echo "building metrics-server $METRICS_SERVER_VERSION into $metrics_server_dir"
  local tmp="$metrics_server_dir.tmp"
  rm -rf "$tmp" && mkdir -p "$tmp"
  CGO_ENABLED=0 GOBIN="$tmp" go install -trimpath -ldflags "-s -w" \
    "sigs.k8s.io/metrics-server/cmd/metrics-server@$METRICS_SERVER_VERSION" ||
    die "building metrics-server $METRICS_SERVER_VERSION failed (see the go output above)"
  rm -rf "$metrics_server_dir" && mv "$tmp" "$metrics_server_dir"
}

case "${1:-all}" in
  kube) build_kube ;;
  kwok) build_kwok ;;
  metrics-server) build_metrics_server ;;
  all) build_kwok; build_metrics_server; build_kube ;;
  *) die "usage: build.sh [all|kube|kwok|metrics-server]" ;;
esac
echo "kube: $kube_dir"
echo "kwok: $kwok_dir"
echo "metrics-server: $metrics_server_dir"
