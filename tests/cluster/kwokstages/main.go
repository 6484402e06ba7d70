// Command kwokstages prints the kwok stage configuration used by localkube: kwok's own default
// node and pod lifecycle stages, taken from the Go strings kwok exports, so no kwok YAML is
// copied into this repository and the stages always match the pinned kwok version.
//
// It lives in its own module because importing kwok next to k8s.io/kubernetes would let kwok's
// newer OpenTelemetry and gRPC requirements leak into the control plane's build graph.
package main

import (
	"fmt"
	"os"
	"strings"

	nodefast "sigs.k8s.io/kwok/kustomize/stage/node/fast"
	nodeheartbeat "sigs.k8s.io/kwok/kustomize/stage/node/heartbeat-with-lease"
	podfast "sigs.k8s.io/kwok/kustomize/stage/pod/fast"
)

func main() {
	// Node init keeps the capacity the node was created with and marks it Ready; the lease
	// heartbeat keeps it Ready; pods on managed nodes become Running and Ready, and Job pods
	// complete with exit code 0. Deleted pods are removed by localkube's pod reaper instead of
	// kwok's pod-delete stage, which deletes by name and so could kill a StatefulSet's
	// replacement of the same name (localkube/reaper.go).
	stages := []string{
		nodefast.DefaultNodeInit,
		nodeheartbeat.DefaultNodeHeartbeatWithLease,
		podfast.DefaultPodReady,
		podfast.DefaultPodComplete,
	}
	docs := make([]string, 0, len(stages))
	for _, s := range stages {
		docs = append(docs, strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(s), "---")))
	}
	if _, err := fmt.Println(strings.Join(docs, "\n---\n")); err != nil {
		fmt.Fprintln(os.Stderr, "kwokstages:", err)
		os.Exit(1)
	}
}
