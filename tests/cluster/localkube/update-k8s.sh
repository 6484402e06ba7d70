#!/usr/bin/env bash
# Regenerate go.mod/go.sum for a Kubernetes version. Run once per version bump, commit the result.
#
# Why: k8s.io/kubernetes requires its staging modules at v0.0.0 and resolves them with replace
# directives that Go ignores in dependencies, so a consumer must replace each staging module with
# its published v0.<minor>.<patch> tag itself. The list changes between minors, so it is derived
# from k/k's own go.mod instead of being hand-written.
#
# Usage: tests/cluster/localkube/update-k8s.sh [v1.36.3]
set -euo pipefail

K8S="${1:-v1.36.3}"
STG="v0.${K8S#v1.}"
cd "$(dirname "$0")"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod

gomod="$(go mod download -json "k8s.io/kubernetes@${K8S}" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
[[ -f "$gomod" ]] || { echo "could not download k8s.io/kubernetes@${K8S}" >&2; exit 1; }

# Start from a clean module file so replaces of a previous version never linger.
goversion="$(awk '$1 == "go" {print $2; exit}' "$gomod")"
cat > go.mod <<EOF
module rljob.local/localkube

go ${goversion}
EOF
rm -f go.sum

mapfile -t staging < <(awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$gomod" | sort -u)
echo "replacing ${#staging[@]} staging modules with @${STG}"
for m in "${staging[@]}"; do
  go mod edit "-replace=${m}=${m}@${STG}"
done

# etcd is embedded in-process; take exactly the version k/k was tested with.
etcd="$(awk '$1 == "go.etcd.io/etcd/server/v3" {print $2; exit}' "$gomod")"
go get "k8s.io/kubernetes@${K8S}" "go.etcd.io/etcd/server/v3@${etcd}"
go mod tidy
echo "go.mod now pins k8s.io/kubernetes ${K8S} (staging ${STG}), etcd ${etcd}"
