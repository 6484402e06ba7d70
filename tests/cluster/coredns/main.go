// Command coredns is CoreDNS v1.15.0 with only the plugins the real node's cluster DNS needs
// (kubernetes, cache, errors, health, ready, log, loadbalance, bind, metrics). The upstream main
// links every plugin, cloud SDKs included; this one builds in a fraction of the time.
package main

import (
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/ready"
)

func main() {
	coremain.Run()
}
