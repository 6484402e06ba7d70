// Command localkube is a multi-call binary holding an unmodified kube-apiserver,
// kube-controller-manager and kube-scheduler, plus an "up" supervisor that runs a loopback-only
// control plane (embedded etcd, those three components as child processes, and kwok for fake
// nodes) for tests.
//
// One binary is linked once; every component still runs in its own process because the upstream
// commands install process-global signal handlers, feature gates and metrics registries.
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	_ "k8s.io/component-base/logs/json/register"          // JSON log format, as the upstream mains register it
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics, as the upstream mains register them
	_ "k8s.io/component-base/metrics/prometheus/version"  // version metric, as the upstream mains register it
	"k8s.io/component-base/version"
	kubectl "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	_ "time/tzdata" // CronJob time zones, as the upstream mains import it
)

const usage = `usage: localkube <command> [flags]

commands:
  up                        run a loopback control plane until SIGTERM (see: localkube up --help)
  kube-apiserver ...        the upstream kube-apiserver command
  kube-controller-manager   the upstream kube-controller-manager command
  kube-scheduler ...        the upstream kube-scheduler command
  node-clean                remove what a killed real node left behind (takes the real-node lock)
  kubectl ...               the upstream kubectl command
  version                   print the Kubernetes version this binary was built from
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	args := os.Args[2:]
	switch os.Args[1] {
	case "kube-apiserver":
		runUpstream(apiserver.NewAPIServerCommand(), args)
	case "kube-controller-manager":
		runUpstream(controllermanager.NewControllerManagerCommand(), args)
	case "kube-scheduler":
		runUpstream(scheduler.NewSchedulerCommand(), args)
	case "kubectl":
		runKubectl(args)
	case "up":
		os.Exit(runUp(args))
	case "node-clean":
		os.Exit(runNodeClean(args))
	case "version", "--version":
		fmt.Println(version.Get().GitVersion)
	default:
		fmt.Fprintf(os.Stderr, "localkube: unknown command %q\n\n%s", os.Args[1], usage)
		os.Exit(2)
	}
}

// runUpstream executes an upstream cobra command with the given arguments and exits with its code.
func runUpstream(cmd *cobra.Command, args []string) {
	cmd.SetArgs(args)
	os.Exit(cli.Run(cmd))
}

// runKubectl runs upstream kubectl the way its own main does. kubectl reads os.Args itself (for
// plugin lookup), so the program name is rewritten to make it see a plain "kubectl ..." call.
func runKubectl(args []string) {
	os.Args = append([]string{"kubectl"}, args...)
	_, _ = logs.GlogSetter(kubectl.GetLogVerbosity(os.Args))
	if err := cli.RunNoErrOutput(kubectl.NewDefaultKubectlCommand()); err != nil {
		kubectlutil.CheckErr(err)
	}
}
