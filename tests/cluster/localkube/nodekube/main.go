// Command nodekube is a multi-call binary holding an unmodified kubelet and kube-proxy, built from
// the same k8s.io/kubernetes module (and go.mod) as localkube, for the one real node of the local
// cluster (see tests/cluster/realnode.sh).
//
// It is a separate binary from localkube so that the control plane, which every cluster test
// needs, is not relinked when only the node is wanted, and the other way round.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // JSON log format, as the upstream mains register it
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics, as the upstream mains register them
	_ "k8s.io/component-base/metrics/prometheus/version"  // version metric, as the upstream mains register it
	"k8s.io/component-base/version"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

const usage = `usage: nodekube <command> [flags]

commands:
  kubelet ...      the upstream kubelet command
  kube-proxy ...   the upstream kube-proxy command
  version          print the Kubernetes version this binary was built from
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	args := os.Args[2:]
	switch os.Args[1] {
	case "kubelet":
		run(kubelet.NewKubeletCommand(context.Background()), args)
	case "kube-proxy":
		run(proxy.NewProxyCommand(), args)
	case "version", "--version":
		fmt.Println(version.Get().GitVersion)
	default:
		fmt.Fprintf(os.Stderr, "nodekube: unknown command %q\n\n%s", os.Args[1], usage)
		os.Exit(2)
	}
}

// run executes an upstream cobra command with the given arguments and exits with its code.
func run(cmd *cobra.Command, args []string) {
	cmd.SetArgs(args)
	os.Exit(cli.Run(cmd))
}
