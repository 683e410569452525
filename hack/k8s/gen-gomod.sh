#!/usr/bin/env bash
# Writes hack/k8s/go.mod for the KUBERNETES_VERSION pinned in versions.env.
# k8s.io/kubernetes requires its staging modules at v0.0.0, so every one of them
# is replaced by the published v0.<minor>.<patch>; the list comes from that
# version's own go.mod rather than being typed by hand.
set -euo pipefail
cd "$(dirname "$0")"
source ./versions.env
staging_version="v0.${KUBERNETES_VERSION#v1.}"
upstream_gomod=$(go mod download -json "k8s.io/kubernetes@${KUBERNETES_VERSION}" |
  sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
{
  echo "module kubestrata.dev/hack/k8s"
  echo
  sed -n 's/^go \(.*\)$/go \1/p' "$upstream_gomod"
  echo
  sed -n 's/^godebug \(.*\)$/godebug \1/p' "$upstream_gomod"
  echo
  echo "require k8s.io/kubernetes ${KUBERNETES_VERSION}"
  echo
  echo "replace ("
  awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$upstream_gomod" | sort -u |
    while read -r module; do echo "	${module} => ${module} ${staging_version}"; done
  echo ")"
} > go.mod
rm -f go.sum
go mod tidy
