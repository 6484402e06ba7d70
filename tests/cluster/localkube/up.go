package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// upOptions are the flags of "localkube up".
type upOptions struct {
	dir            string
	etcdDir        string
	kwokBinary     string
	kwokConfig     string
	nvidiaNodes    int
	amdNodes       int
	cpuNodes       int
	gpusPerNode    int
	nvidiaProduct  string
	amdProduct     string
	taintGPUNodes  bool
	exitWithParent bool
	timeout        time.Duration
	realNode       realNodeOptions
}

// readyInfo is written as JSON to <dir>/ready once the control plane serves and all nodes are
// Ready; its presence is the contract callers wait on.
type readyInfo struct {
	Server     string `json:"server"`
	Kubeconfig string `json:"kubeconfig"`
	PID        int    `json:"pid"`
	Version    string `json:"version"`
	// Set when a real node runs: its name and containerd's socket (for `ctr images import`).
	RealNode         string `json:"realNode,omitempty"`
	ContainerdSocket string `json:"containerdSocket,omitempty"`
	// The node's network namespace (/proc/<pid>/ns/net), for tests that read its firewall rules.
	NodeNetns string `json:"nodeNetns,omitempty"`
}

func parseUpOptions(args []string) (upOptions, error) {
	var o upOptions
	fs := flag.NewFlagSet("localkube up", flag.ContinueOnError)
	fs.StringVar(&o.dir, "dir", "", "state directory (certificates, kubeconfig, logs, ready file); required")
	fs.StringVar(&o.etcdDir, "etcd-dir", "", "etcd data directory (default <dir>/etcd; tmpfs is faster)")
	fs.StringVar(&o.kwokBinary, "kwok", "", "path to the kwok binary; required")
	fs.StringVar(&o.kwokConfig, "kwok-config", "", "kwok stage configuration file; required")
	fs.IntVar(&o.nvidiaNodes, "nvidia-nodes", 2, "fake nodes with nvidia.com/gpu capacity")
	fs.IntVar(&o.amdNodes, "amd-nodes", 2, "fake nodes with amd.com/gpu capacity")
	fs.IntVar(&o.cpuNodes, "cpu-nodes", 1, "fake nodes without GPUs")
	fs.IntVar(&o.gpusPerNode, "gpus-per-node", 8, "GPU capacity of each GPU node")
	fs.StringVar(&o.nvidiaProduct, "nvidia-product", "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.product label value")
	fs.StringVar(&o.amdProduct, "amd-product", "AMD_Instinct_MI300X_OAM", "amd.com/gpu.product-name label value")
	fs.BoolVar(&o.taintGPUNodes, "taint-gpu-nodes", false, "taint GPU nodes <vendor>.com/gpu=present:NoSchedule, as GPU clusters usually are")
	fs.BoolVar(&o.exitWithParent, "exit-with-parent", false, "shut down when the process that started this one dies (for test runners that may be killed)")
	fs.DurationVar(&o.timeout, "timeout", 180*time.Second, "how long to wait for the control plane to become ready")
	o.realNode.register(fs)
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if err := o.realNode.validate(); err != nil {
		return o, err
	}
	if o.dir == "" || o.kwokBinary == "" || o.kwokConfig == "" {
		return o, errors.New("--dir, --kwok and --kwok-config are required")
	}
	if o.nvidiaNodes < 0 || o.amdNodes < 0 || o.cpuNodes < 0 || o.gpusPerNode < 1 {
		return o, errors.New("node counts must be >= 0 and --gpus-per-node >= 1")
	}
	if o.etcdDir == "" {
		o.etcdDir = filepath.Join(o.dir, "etcd")
	}
	return o, nil
}

// runUp brings the control plane up, reports readiness, and blocks until SIGTERM/SIGINT or until
// a component dies; it always tears everything down before returning the exit code.
func runUp(args []string) int {
	// Children get Pdeathsig, which fires when the *thread* that started them exits; pinning this
	// goroutine to its thread ties the children to the supervisor's lifetime instead.
	runtime.LockOSThread()
	log.SetFlags(log.Ltime)
	log.SetPrefix("localkube: ")
	o, err := parseUpOptions(args)
	if err != nil {
		log.Print(err)
		return 2
	}
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	if o.exitWithParent {
		go watchParent(os.Getppid(), signals)
	}

	if o.realNode.enabled {
		if err := os.MkdirAll(o.dir, 0o755); err != nil {
			log.Print(err)
			return 1
		}
		lock, err := acquireNodeLock(o.realNode.lockPath, o.realNode.lockTimeout, o.dir, signals)
		if err != nil {
			log.Print(err)
			return 1
		}
		// Released last, after the node's teardown below.
		defer lock.Close()
	}

	sup := &supervisor{exited: make(chan string, 16)}
	var etcdClose func()
	var node *realNode
	defer func() {
		sup.stopAll(15 * time.Second)
		if node != nil {
			node.stop()
		}
		if etcdClose != nil {
			etcdClose()
		}
		// The data only ever belongs to this run.
		_ = os.RemoveAll(o.etcdDir)
		_ = os.Remove(filepath.Join(o.dir, "ready"))
		log.Print("stopped")
	}()

	info, closeEtcd, err := start(o, sup, signals, &node)
	etcdClose = closeEtcd
	if err != nil {
		log.Printf("startup failed: %v (component logs in %s)", err, filepath.Join(o.dir, "logs"))
		return 1
	}
	// Runs until shutdown; cancelled (deferred last, so first) before the components stop.
	reaperCtx, stopReaper := context.WithCancel(context.Background())
	defer stopReaper()
	if err := runPodReaper(reaperCtx, info.Kubeconfig); err != nil {
		log.Printf("pod reaper: %v", err)
		return 1
	}
	data, _ := json.Marshal(info)
	if err := os.WriteFile(filepath.Join(o.dir, "ready"), data, 0o644); err != nil {
		log.Print(err)
		return 1
	}
	log.Printf("ready: %s (KUBECONFIG=%s)", info.Server, info.Kubeconfig)
	select {
	case sig := <-signals:
		log.Printf("%s received, shutting down", sig)
		return 0
	case name := <-sup.exited:
		log.Printf("%s exited unexpectedly, shutting down (see %s)", name, filepath.Join(o.dir, "logs", name+".log"))
		return 1
	}
}

// watchParent reports SIGTERM once this process is re-parented, i.e. its starter died (a killed
// pytest would otherwise leave a whole control plane running in its own process group).
func watchParent(parent int, signals chan<- os.Signal) {
	for range time.Tick(time.Second) {
		if os.Getppid() != parent {
			log.Printf("parent process %d is gone", parent)
			signals <- syscall.SIGTERM
			return
		}
	}
}

// start runs every component in dependency order and returns once the cluster is usable.
func start(o upOptions, sup *supervisor, signals <-chan os.Signal, node **realNode) (readyInfo, func(), error) {
	timeout := o.timeout
	if o.realNode.enabled {
		timeout += o.realNode.timeout
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	go func() {
		// A signal during startup aborts the waits below; the caller then tears down.
		select {
		case <-signals:
			cancel()
		case <-ctx.Done():
		}
	}()

	logDir := filepath.Join(o.dir, "logs")
	for _, d := range []string{o.dir, logDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return readyInfo{}, nil, err
		}
	}
	_ = os.Remove(filepath.Join(o.dir, "ready"))
	self, err := os.Executable()
	if err != nil {
		return readyInfo{}, nil, err
	}
	ports, err := freePorts(5)
	if err != nil {
		return readyInfo{}, nil, err
	}
	etcdPort, peerPort, apiPort, kcmPort, schedPort := ports[0], ports[1], ports[2], ports[3], ports[4]

	pki, err := writePKI(filepath.Join(o.dir, "pki"))
	if err != nil {
		return readyInfo{}, nil, fmt.Errorf("pki: %w", err)
	}
	server := fmt.Sprintf("https://127.0.0.1:%d", apiPort)
	kubeconfig := filepath.Join(o.dir, "kubeconfig")
	if err := writeKubeconfig(kubeconfig, server, pki); err != nil {
		return readyInfo{}, nil, err
	}

	var nodeArgs []string
	if o.realNode.enabled {
		n, args, err := prepareRealNode(o, pki)
		if err != nil {
			return readyInfo{}, nil, err
		}
		*node, nodeArgs = n, args
	}

	etcd, etcdURL, err := startEtcd(o.etcdDir, filepath.Join(logDir, "etcd.log"), etcdPort, peerPort)
	if err != nil {
		return readyInfo{}, nil, err
	}
	closeEtcd := etcd.Close

	apiserverArgs := []string{"kube-apiserver",
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		fmt.Sprintf("--secure-port=%d", apiPort),
		"--cert-dir=" + filepath.Join(o.dir, "apiserver"),
		"--tls-cert-file=" + pki.ServingCert,
		"--tls-private-key-file=" + pki.ServingKey,
		"--client-ca-file=" + pki.CACert,
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-signing-key-file=" + pki.SAKey,
		"--service-account-key-file=" + pki.SAPub,
		"--service-cluster-ip-range=10.96.0.0/16",
		"--authorization-mode=RBAC",
		// As production clusters (OpenShift, hardened kubeadm) run it: setting blockOwnerDeletion on a
		// child needs update on the owner's finalizers, so the chart's RBAC is tested against it.
		"--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
		"--allow-privileged=true",
		// Loopback addresses are invalid in the "kubernetes" Endpoints object.
		"--endpoint-reconciler-type=none",
		// Priority-and-fairness costs CPU the 2-core CI machine does not have to spare.
		"--enable-priority-and-fairness=false",
		"--profiling=false",
	}
	// The real node's flags replace those of the same name above (--authorization-mode: a list
	// flag, where a repeat would add to the list).
	for _, arg := range nodeArgs {
		name := strings.SplitN(arg, "=", 2)[0] + "="
		kept := apiserverArgs[:0]
		for _, a := range apiserverArgs {
			if !strings.HasPrefix(a, name) {
				kept = append(kept, a)
			}
		}
		apiserverArgs = append(kept, arg)
	}
	if err := sup.start(logDir, "kube-apiserver", self, apiserverArgs...); err != nil {
		return readyInfo{}, closeEtcd, err
	}

	restCfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return readyInfo{}, closeEtcd, err
	}
	restCfg.QPS, restCfg.Burst = 100, 200
	cs, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return readyInfo{}, closeEtcd, err
	}
	if err := waitFor(ctx, sup, "kube-apiserver /readyz", func(ctx context.Context) bool {
		body, err := cs.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		return err == nil && string(body) == "ok"
	}); err != nil {
		return readyInfo{}, closeEtcd, err
	}
	log.Printf("kube-apiserver ready on %s", server)

	common := []string{
		"--kubeconfig=" + kubeconfig,
		"--authentication-kubeconfig=" + kubeconfig,
		"--authorization-kubeconfig=" + kubeconfig,
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		"--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
	}
	if err := sup.start(logDir, "kube-controller-manager", self, append([]string{"kube-controller-manager"}, append(common,
		fmt.Sprintf("--secure-port=%d", kcmPort),
		"--cert-dir="+filepath.Join(o.dir, "kube-controller-manager"),
		"--root-ca-file="+pki.CACert,
		"--service-account-private-key-file="+pki.SAKey,
		"--use-service-account-credentials=true",
		"--kube-api-qps=100",
		"--kube-api-burst=200",
		// kwok renews node leases; a generous grace period avoids taints when CI is starved.
		"--node-monitor-grace-period=120s",
	)...)...); err != nil {
		return readyInfo{}, closeEtcd, err
	}
	if err := sup.start(logDir, "kube-scheduler", self, append([]string{"kube-scheduler"}, append(common,
		fmt.Sprintf("--secure-port=%d", schedPort),
		"--cert-dir="+filepath.Join(o.dir, "kube-scheduler"),
	)...)...); err != nil {
		return readyInfo{}, closeEtcd, err
	}
	if err := sup.start(logDir, "kwok", o.kwokBinary,
		"--kubeconfig="+kubeconfig,
		"--config="+o.kwokConfig,
		"--manage-all-nodes=false",
		"--manage-nodes-with-annotation-selector="+kwokAnnotation+"=fake",
		// Fake pod IPs, never contacted; loopback IPs are rejected by EndpointSlice validation.
		"--cidr=10.244.0.0/16",
		"--node-ip=127.0.0.1",
		// Without leases the node-lifecycle controller taints the nodes and evicts pods.
		"--node-lease-duration-seconds=40",
	); err != nil {
		return readyInfo{}, closeEtcd, err
	}

	nodes := fakeNodes(nodePools(o))
	if err := createNodes(ctx, cs, nodes); err != nil {
		return readyInfo{}, closeEtcd, err
	}
	names := make([]string, len(nodes))
	for i, n := range nodes {
		names[i] = n.Name
	}
	if err := waitFor(ctx, sup, "fake nodes Ready (kwok)", func(ctx context.Context) bool {
		return waitNodesReady(ctx, cs, names, time.Second) == nil
	}); err != nil {
		return readyInfo{}, closeEtcd, err
	}
	// The default ServiceAccount proves the controller-manager is reconciling; pods cannot be
	// admitted in a namespace before it exists.
	if err := waitFor(ctx, sup, "default ServiceAccount (kube-controller-manager)", func(ctx context.Context) bool {
		_, err := cs.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		return err == nil
	}); err != nil {
		return readyInfo{}, closeEtcd, err
	}
	info := readyInfo{Server: server, Kubeconfig: kubeconfig, PID: os.Getpid()}
	if *node != nil {
		started := time.Now()
		if err := (*node).start(ctx, sup, cs, logDir, apiPort); err != nil {
			return readyInfo{}, closeEtcd, fmt.Errorf("real node: %w", err)
		}
		log.Printf("real node %s Ready in %.1f s", o.realNode.name, time.Since(started).Seconds())
		info.RealNode, info.ContainerdSocket = o.realNode.name, (*node).socket
		info.NodeNetns = fmt.Sprintf("/proc/%d/ns/net", (*node).holder)
	}
	v, err := cs.Discovery().ServerVersion()
	if err != nil {
		return readyInfo{}, closeEtcd, err
	}
	info.Version = v.GitVersion
	return info, closeEtcd, nil
}

// waitFor polls cond until it holds, the context ends, or a supervised component exits.
func waitFor(ctx context.Context, sup *supervisor, what string, cond func(context.Context) bool) error {
	err := wait.PollUntilContextCancel(ctx, 300*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		select {
		case name := <-sup.exited:
			return false, fmt.Errorf("%s exited while waiting for %s", name, what)
		default:
		}
		return cond(ctx), nil
	})
	if err != nil && ctx.Err() != nil {
		return fmt.Errorf("gave up waiting for %s: %w", what, ctx.Err())
	}
	return err
}

// freePorts reserves n distinct loopback ports by holding all listeners open at once.
func freePorts(n int) ([]int, error) {
	var ports []int
	var listeners []net.Listener
	defer func() {
		for _, l := range listeners {
			_ = l.Close()
		}
	}()
	for i := 0; i < n; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		listeners = append(listeners, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// writeKubeconfig writes a self-contained admin kubeconfig (certificates embedded).
func writeKubeconfig(path, server string, pki pkiFiles) error {
	read := func(p string) []byte {
		b, err := os.ReadFile(p)
		if err != nil {
			panic(err) // written moments ago by writePKI
		}
		return b
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["localkube"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: read(pki.CACert)}
	cfg.AuthInfos["admin"] = &clientcmdapi.AuthInfo{
		ClientCertificateData: read(pki.AdminCert), ClientKeyData: read(pki.AdminKey),
	}
	cfg.Contexts["localkube"] = &clientcmdapi.Context{Cluster: "localkube", AuthInfo: "admin", Namespace: "default"}
	cfg.CurrentContext = "localkube"
	return clientcmd.WriteToFile(*cfg, path)
}
