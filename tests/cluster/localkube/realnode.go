package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// One real node per machine: kubelet, containerd, kube-proxy and kube-router run in a network and mount
// namespace of their own (the "node namespace"), so iptables rules, the CNI bridge, pod network
// namespaces, kubelet volume mounts and containerd's /run state never touch the host; only
// cgroups and a few mount points are global. A machine-wide flock serialises concurrent users.
const (
	defaultNodeRoot = "/var/lib/rljob-real-node"
	defaultNodeLock = "/run/rljob-real-node.lock"
	// cgroupName is the kubelet's cgroupRoot and the parent of every node process's cgroup, in
	// every v1 hierarchy; teardown kills what is left in it and removes it.
	cgroupName = "rljob-real-node"
	// Addresses: the node IP lives on the node namespace's loopback (there is no dummy link);
	// pods get 10.245.0.0/24 on the CNI bridge; Services are 10.96.0.0/16 (the apiserver's range).
	nodeIPString  = "10.250.0.1"
	podSubnet     = "10.245.0.0/24"
	podCIDR       = "10.245.0.0/16"
	serviceCIDR   = "10.96.0.0/16"
	nodeAPIPort   = 6443
	kubeletPort   = 10250
	clusterDomain = "cluster.local"
)

// Kernel tunables the kubelet insists on setting (vm.overcommit_memory=1, kernel.panic_on_oops=1,
// ...). They are global, so the node namespace bind-mounts private files over them: the kubelet
// "sets" its values and the host keeps its own.
var fakedSysctls = []string{"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
	"kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes"}

type realNodeOptions struct {
	enabled      bool
	name         string
	root         string
	lockPath     string
	lockTimeout  time.Duration
	timeout      time.Duration
	nodekube     string
	containerd   string // folder holding containerd, containerd-shim-runc-v2 and ctr
	runc         string
	cniBin       string
	coredns      string
	kubeRouter   string
	pauseImage   string
	pauseArchive string
	images       []string // more image archives to import before the node is reported ready
}

func (r *realNodeOptions) register(fs *flag.FlagSet) {
	fs.BoolVar(&r.enabled, "real-node", false, "also run one real node (kubelet, containerd, kube-proxy, CoreDNS) in its own network namespace")
	fs.StringVar(&r.name, "real-node-name", "real-0", "name of the real node")
	fs.StringVar(&r.root, "real-node-root", defaultNodeRoot, "state folder of the real node (wiped at start and stop)")
	fs.StringVar(&r.lockPath, "real-node-lock", defaultNodeLock, "machine-wide lock file: one real node per machine")
	fs.DurationVar(&r.lockTimeout, "real-node-lock-timeout", 60*time.Minute, "how long to wait for another real node on this machine to go away")
	fs.DurationVar(&r.timeout, "real-node-timeout", 300*time.Second, "how long to wait for the real node to become Ready (images imported)")
	fs.StringVar(&r.nodekube, "nodekube", "", "path of the nodekube binary (kubelet, kube-proxy)")
	fs.StringVar(&r.containerd, "containerd-bin-dir", "", "folder with containerd, containerd-shim-runc-v2 and ctr")
	fs.StringVar(&r.runc, "runc", "", "path of runc")
	fs.StringVar(&r.cniBin, "cni-bin-dir", "", "folder with the CNI plugins (bridge, host-local, loopback, portmap)")
	fs.StringVar(&r.coredns, "coredns", "", "path of the coredns binary")
	fs.StringVar(&r.kubeRouter, "kube-router", "", "path of the kube-router binary (its firewall enforces NetworkPolicies)")
	fs.StringVar(&r.pauseImage, "pause-image", "", "sandbox image reference (must be in --pause-image-archive)")
	fs.StringVar(&r.pauseArchive, "pause-image-archive", "", "OCI archive of the sandbox image")
	fs.Func("real-node-image", "OCI archive to import into the node's containerd (repeatable)", func(s string) error {
		r.images = append(r.images, s)
		return nil
	})
}

func (r *realNodeOptions) validate() error {
	if !r.enabled {
		return nil
	}
	if os.Geteuid() != 0 {
		return errors.New("--real-node needs root (namespaces, mounts, cgroups)")
	}
	for flagName, p := range map[string]string{
		"--nodekube": r.nodekube, "--containerd-bin-dir": r.containerd, "--runc": r.runc,
		"--cni-bin-dir": r.cniBin, "--coredns": r.coredns, "--kube-router": r.kubeRouter, "--pause-image-archive": r.pauseArchive,
	} {
		if p == "" {
			return fmt.Errorf("--real-node needs %s", flagName)
		}
		if _, err := os.Stat(p); err != nil {
			return fmt.Errorf("%s: %w", flagName, err)
		}
	}
	if r.pauseImage == "" {
		return errors.New("--real-node needs --pause-image")
	}
	return nil
}

func nodeIP() net.IP { return net.ParseIP(nodeIPString) }

// inNodeNetwork reports whether the apiserver's egress to ip must enter the node namespace.
func inNodeNetwork(ip net.IP) bool {
	for _, cidr := range []string{podCIDR, serviceCIDR, nodeIPString + "/32"} {
		_, n, _ := net.ParseCIDR(cidr)
		if n.Contains(ip) {
			return true
		}
	}
	return false
}

// ---------------------------------------------------------------------------------------------
// machine-wide lock

// acquireNodeLock blocks until this process holds the machine's real-node lock. The lock is an
// flock: the kernel drops it when the holder dies, however it dies. The file descriptor is
// close-on-exec, so no child (containerd's shims in particular) can keep it.
func acquireNodeLock(path string, timeout time.Duration, stateDir string, signals <-chan os.Signal) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		holder, _ := os.ReadFile(path)
		log.Printf("another real node runs on this machine (%s); waiting up to %s for it to stop", strings.TrimSpace(string(holder)), timeout)
		waiting := filepath.Join(stateDir, "waiting-for-real-node-lock")
		_ = os.WriteFile(waiting, holder, 0o644)
		defer os.Remove(waiting)
		deadline := time.Now().Add(timeout)
		for {
			select {
			case sig := <-signals:
				_ = f.Close()
				return nil, fmt.Errorf("%s while waiting for the real-node lock", sig)
			case <-time.After(time.Second):
			}
			if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err == nil {
				break
			}
			if time.Now().After(deadline) {
				_ = f.Close()
				return nil, fmt.Errorf("the real-node lock %s is still held after %s by: %s", path, timeout, strings.TrimSpace(string(holder)))
			}
		}
	}
	_ = f.Truncate(0)
	_, _ = f.WriteAt([]byte(fmt.Sprintf("pid=%d dir=%s since=%s\n", os.Getpid(), stateDir, time.Now().Format(time.RFC3339))), 0)
	return f, nil
}

// ---------------------------------------------------------------------------------------------
// cgroups and teardown

// cgroupHierarchies lists the mounted cgroup hierarchies (v1 controllers, the named systemd
// hierarchy and a hybrid unified one).
func cgroupHierarchies() []string {
	entries, _ := os.ReadDir("/sys/fs/cgroup")
	var out []string
	for _, e := range entries {
		p := filepath.Join("/sys/fs/cgroup", e.Name())
		if _, err := os.Stat(filepath.Join(p, "cgroup.procs")); err == nil {
			out = append(out, p)
		}
	}
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.procs"); err == nil {
		out = append(out, "/sys/fs/cgroup") // pure cgroup v2
	}
	return out
}

// trackingCgroup is the cgroup every node process (and containerd's shims) is moved into, so
// teardown finds them even after a crash.
func trackingCgroup() string {
	for _, h := range []string{"pids", "memory", "systemd"} {
		p := filepath.Join("/sys/fs/cgroup", h)
		if _, err := os.Stat(filepath.Join(p, "cgroup.procs")); err == nil {
			return filepath.Join(p, cgroupName, "system")
		}
	}
	return filepath.Join("/sys/fs/cgroup", cgroupName, "system")
}

func setupCgroups() error {
	for _, h := range cgroupHierarchies() {
		for _, d := range []string{filepath.Join(h, cgroupName), filepath.Join(h, cgroupName, "system")} {
			if err := os.MkdirAll(d, 0o755); err != nil {
				return fmt.Errorf("cgroup %s: %w", d, err)
			}
			if filepath.Base(h) == "cpuset" {
				// A v1 cpuset cgroup takes no tasks until it has CPUs and memory nodes.
				for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
					v, err := os.ReadFile(filepath.Join(filepath.Dir(d), f))
					if err == nil {
						_ = os.WriteFile(filepath.Join(d, f), bytes.TrimSpace(v), 0o644)
					}
				}
			}
		}
	}
	return nil
}

func trackProcess(pid int) error {
	return os.WriteFile(filepath.Join(trackingCgroup(), "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644)
}

// nodeCgroupDirs returns every cgroup under rljob-real-node in every hierarchy, deepest first.
func nodeCgroupDirs() []string {
	var dirs []string
	for _, h := range cgroupHierarchies() {
		root := filepath.Join(h, cgroupName)
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
	}
	sort.Slice(dirs, func(i, j int) bool { return strings.Count(dirs[i], "/") > strings.Count(dirs[j], "/") })
	return dirs
}

// cleanupRealNode removes everything a real node leaves behind, whether it stopped cleanly or
// crashed: it kills every process in the node's cgroups (containers, containerd's shims, the
// node components), which also ends the node namespace with its mounts, iptables rules and pod
// network namespaces; then it removes the cgroups and the node's state folders.
func cleanupRealNode(root string) {
	self := os.Getpid()
	var left []int
	for attempt := 0; attempt < 100; attempt++ {
		left = left[:0]
		for _, d := range nodeCgroupDirs() {
			data, err := os.ReadFile(filepath.Join(d, "cgroup.procs"))
			if err != nil {
				continue
			}
			for _, f := range strings.Fields(string(data)) {
				if pid, err := strconv.Atoi(f); err == nil && pid != self {
					left = append(left, pid)
				}
			}
		}
		if len(left) == 0 {
			break
		}
		for _, pid := range left {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if len(left) > 0 {
		log.Printf("real node: processes %v survived SIGKILL", left)
	}
	for attempt := 0; attempt < 50; attempt++ {
		busy := 0
		for _, d := range nodeCgroupDirs() {
			if err := syscall.Rmdir(d); err != nil && !errors.Is(err, syscall.ENOENT) {
				busy++
			}
		}
		if busy == 0 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if d := nodeCgroupDirs(); len(d) > 0 {
		log.Printf("real node: cgroups left behind: %v", d)
	}
	for _, d := range []string{"run", "kubelet", "log", "cni"} {
		if err := os.RemoveAll(filepath.Join(root, d)); err != nil {
			log.Printf("real node: %v", err)
		}
	}
	// Mount points this node created on the host (empty folders), recorded at creation.
	if data, err := os.ReadFile(filepath.Join(root, "created-mountpoints")); err == nil {
		for _, p := range strings.Fields(string(data)) {
			_ = syscall.Rmdir(p)
		}
		_ = os.Remove(filepath.Join(root, "created-mountpoints"))
	}
}

// ---------------------------------------------------------------------------------------------
// start

// realNode is a running real node.
type realNode struct {
	opts   realNodeOptions
	pki    nodePKI
	netns  *os.File // the node's network namespace, held open for the bridges
	holder int      // pid of the process owning the node's namespaces (tests enter its network namespace)
	bridge bridge
	socket string // containerd's socket (reachable from the host)
	ctr    string
	caFile string // the cluster CA (kubelet's client CA)
}

func (n *realNode) nsPath() string { return fmt.Sprintf("/proc/self/fd/%d", n.netns.Fd()) }

// prepareRealNode runs before the apiserver starts: it removes what a crashed node left behind,
// creates the node's credentials and returns the extra kube-apiserver flags.
func prepareRealNode(o upOptions, pki pkiFiles) (*realNode, []string, error) {
	r := o.realNode
	cleanupRealNode(r.root)
	n := &realNode{opts: r, socket: filepath.Join(r.root, "run", "containerd.sock"), ctr: filepath.Join(r.containerd, "ctr"), caFile: pki.CACert}
	for _, d := range []string{"run", "kubelet", "log", "cni"} {
		if err := os.MkdirAll(filepath.Join(r.root, d), 0o755); err != nil {
			return nil, nil, err
		}
	}
	np, err := writeNodePKI(filepath.Join(r.root, "run", "pki"), pki, r.name, nodeIP(),
		fmt.Sprintf("https://127.0.0.1:%d", nodeAPIPort))
	if err != nil {
		return nil, nil, fmt.Errorf("node pki: %w", err)
	}
	n.pki = np
	egress := filepath.Join(r.root, "run", "egress-selector.yaml")
	if err := os.WriteFile(egress, []byte(fmt.Sprintf(`apiVersion: apiserver.k8s.io/v1beta1
kind: EgressSelectorConfiguration
egressSelections:
- name: cluster
  connection:
    proxyProtocol: HTTPConnect
    transport:
      uds:
        udsName: %s
`, n.egressSocket())), 0o644); err != nil {
		return nil, nil, err
	}
	return n, []string{
		// The Node authorizer and NodeRestriction: the kubelet gets exactly a node's rights.
		"--authorization-mode=Node,RBAC",
		"--enable-admission-plugins=NodeRestriction,OwnerReferencesPermissionEnforcement",
		"--kubelet-client-certificate=" + np.APIServerKubeletCert,
		"--kubelet-client-key=" + np.APIServerKubeletKey,
		"--kubelet-certificate-authority=" + pki.CACert,
		"--kubelet-preferred-address-types=InternalIP,Hostname",
		// apiserver -> kubelet (logs, exec, port-forward) and node/pod/service proxies go through
		// the supervisor's CONNECT proxy, which dials into the node namespace.
		"--egress-selector-config-file=" + egress,
	}, nil
}

func (n *realNode) egressSocket() string { return filepath.Join(n.opts.root, "run", "egress.sock") }

// start brings the node up once the control plane serves; it returns when the node is Ready.
func (n *realNode) start(ctx context.Context, sup *supervisor, cs kubernetes.Interface, logDir string, apiPort int) error {
	r := n.opts
	if err := createNodeRBAC(ctx, cs); err != nil {
		return err
	}
	if err := createAPIServerEndpoints(ctx, cs); err != nil {
		return err
	}
	if err := setupCgroups(); err != nil {
		return err
	}
	holderPID, err := n.startNamespaces(ctx, sup, logDir)
	if err != nil {
		return err
	}
	netns, err := os.Open(fmt.Sprintf("/proc/%d/ns/net", holderPID))
	if err != nil {
		return err
	}
	n.netns, n.holder = netns, holderPID

	// Bridges: the apiserver inside the node namespace, and the apiserver's egress into it.
	l, err := listenInNetns(n.nsPath(), fmt.Sprintf(":%d", nodeAPIPort))
	if err != nil {
		return fmt.Errorf("apiserver bridge: %w", err)
	}
	apiAddr := fmt.Sprintf("127.0.0.1:%d", apiPort)
	n.bridge.forward("apiserver bridge", l, func(ctx context.Context) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "tcp", apiAddr)
	})
	_ = os.Remove(n.egressSocket())
	el, err := net.Listen("unix", n.egressSocket())
	if err != nil {
		return fmt.Errorf("egress proxy: %w", err)
	}
	n.bridge.connectProxy(el, n.nsPath(), inNodeNetwork)

	cfg, err := n.writeConfigs()
	if err != nil {
		return err
	}
	env := append(os.Environ(), "PATH="+r.containerd+":"+filepath.Dir(r.runc)+":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	inNode := func(name string, args ...string) *exec.Cmd {
		c := exec.Command("nsenter", append([]string{"--target", strconv.Itoa(holderPID), "--mount", "--net", "--"}, args...)...)
		c.Env = env
		return c
	}
	startTracked := func(name string, cmd *exec.Cmd) error {
		pid, err := sup.startCmd(logDir, name, cmd)
		if err != nil {
			return err
		}
		return trackProcess(pid)
	}

	if err := startTracked("containerd", inNode("containerd", filepath.Join(r.containerd, "containerd"), "--config", cfg.containerd)); err != nil {
		return err
	}
	if err := waitFor(ctx, sup, "containerd", func(ctx context.Context) bool {
		return exec.CommandContext(ctx, n.ctr, "--address", n.socket, "version").Run() == nil
	}); err != nil {
		return err
	}
	started := time.Now()
	for _, archive := range append([]string{r.pauseArchive}, r.images...) {
		if err := n.importImage(ctx, archive); err != nil {
			return err
		}
	}
	log.Printf("real node: %d image(s) imported in %.1f s", 1+len(r.images), time.Since(started).Seconds())

	if err := startTracked("kubelet", inNode("kubelet", r.nodekube, "kubelet",
		"--config="+cfg.kubelet,
		"--kubeconfig="+n.pki.KubeletKubeconfig,
		"--hostname-override="+r.name,
		"--node-ip="+nodeIPString,
		"--node-labels=rljob.io/real-node=true",
		"--v=1",
	)); err != nil {
		return err
	}
	if err := startTracked("kube-proxy", inNode("kube-proxy", r.nodekube, "kube-proxy", "--config="+cfg.kubeProxy, "--v=1")); err != nil {
		return err
	}
	if err := startTracked("coredns", inNode("coredns", r.coredns, "-conf", cfg.corefile)); err != nil {
		return err
	}
	if err := waitFor(ctx, sup, "real node "+r.name+" Ready", func(ctx context.Context) bool {
		node, err := cs.CoreV1().Nodes().Get(ctx, r.name, metav1.GetOptions{})
		if err != nil {
			return false
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				return c.Status == corev1.ConditionTrue
			}
		}
		return false
	}); err != nil {
		return err
	}
	// kube-router's firewall only: kube-proxy serves Services and the CNI bridge routes pods. It reads the
	// node's InternalIP to find the node's pods, so it starts once the node is registered. Its rules hang
	// off FORWARD (bridged pod-to-pod traffic passes iptables: bridge-nf-call-iptables above); ipsets and
	// iptables are per network namespace, so the host's stay untouched.
	if err := startTracked("kube-router", inNode("kube-router", r.kubeRouter,
		"--kubeconfig="+n.pki.KubeRouterKubeconfig,
		"--hostname-override="+r.name,
		"--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
		"--enable-pod-egress=false",
		"--service-cluster-ip-range="+serviceCIDR,
		"--health-port=0", "--metrics-port=0",
		"--v=1",
	)); err != nil {
		return err
	}
	// Ready once its policy controller has hooked its chain into FORWARD (its first full sync follows).
	if err := waitFor(ctx, sup, "kube-router's network policy chains", func(ctx context.Context) bool {
		out, err := exec.CommandContext(ctx, "nsenter", "--target", strconv.Itoa(holderPID), "--net", "--",
			"iptables", "-w", "-S", "FORWARD").Output()
		return err == nil && strings.Contains(string(out), "-j KUBE-ROUTER-FORWARD")
	}); err != nil {
		return err
	}
	return waitFor(ctx, sup, "CoreDNS ready", func(ctx context.Context) bool {
		c, err := dialInNetns(ctx, n.nsPath(), "127.0.0.1:18181")
		if err != nil {
			return false
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		_, _ = fmt.Fprintf(c, "GET /ready HTTP/1.0\r\n\r\n")
		buf := make([]byte, 12)
		k, _ := c.Read(buf)
		return strings.HasPrefix(string(buf[:k]), "HTTP/1.0 200") || strings.HasPrefix(string(buf[:k]), "HTTP/1.1 200")
	})
}

// startNamespaces starts the process that owns the node's network and mount namespaces and
// prepares them: node IP on loopback, forwarding on, private /run, /var/log, /var/lib/kubelet,
// /var/lib/cni, and the faked kernel tunables. It returns the holder's pid once it is set up.
func (n *realNode) startNamespaces(ctx context.Context, sup *supervisor, logDir string) (int, error) {
	r := n.opts
	var created []string
	for _, p := range []string{"/var/lib/kubelet", "/var/lib/cni"} {
		if _, err := os.Stat(p); errors.Is(err, os.ErrNotExist) {
			if err := os.MkdirAll(p, 0o755); err != nil {
				return 0, err
			}
			created = append(created, p)
		}
	}
	if len(created) > 0 {
		if err := os.WriteFile(filepath.Join(r.root, "created-mountpoints"), []byte(strings.Join(created, "\n")+"\n"), 0o644); err != nil {
			return 0, err
		}
	}
	sysctlDir := filepath.Join(r.root, "run", "sysctl")
	if err := os.MkdirAll(sysctlDir, 0o755); err != nil {
		return 0, err
	}
	var binds []string
	for _, s := range fakedSysctls {
		v, err := os.ReadFile(filepath.Join("/proc/sys", s))
		if err != nil {
			continue
		}
		fake := filepath.Join(sysctlDir, strings.ReplaceAll(s, "/", "."))
		if err := os.WriteFile(fake, v, 0o644); err != nil {
			return 0, err
		}
		binds = append(binds, fmt.Sprintf("mount --bind %s /proc/sys/%s", fake, s))
	}
	ready := filepath.Join(r.root, "run", "namespaces-ready")
	script := strings.Join(append([]string{
		"ip link set lo up",
		"ip addr add " + nodeIPString + "/32 dev lo",
		"echo 1 > /proc/sys/net/ipv4/ip_forward",
		// Pod-to-Service-to-pod on the same bridge needs bridged traffic to pass iptables
		// (per network namespace since Linux 5.3).
		"if [ -e /proc/sys/net/bridge/bridge-nf-call-iptables ]; then echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables; fi",
		"mount -t tmpfs -o mode=0755 rljob-node-run /run",
		"mount --bind " + filepath.Join(r.root, "log") + " /var/log",
		"mount --bind " + filepath.Join(r.root, "kubelet") + " /var/lib/kubelet",
		"mount --bind " + filepath.Join(r.root, "cni") + " /var/lib/cni",
	}, append(binds,
		"touch "+ready,
		"exec sleep infinity",
	)...), "\n")
	cmd := exec.Command("unshare", "--mount", "--net", "--propagation", "private", "--", "/bin/sh", "-ec", script)
	pid, err := sup.startCmd(logDir, "node-namespaces", cmd)
	if err != nil {
		return 0, err
	}
	if err := trackProcess(pid); err != nil {
		return 0, err
	}
	if err := waitFor(ctx, sup, "node namespaces", func(context.Context) bool {
		_, err := os.Stat(ready)
		return err == nil
	}); err != nil {
		return 0, err
	}
	return pid, nil
}

func (n *realNode) importImage(ctx context.Context, archive string) error {
	started := time.Now()
	out, err := exec.CommandContext(ctx, n.ctr, "--address", n.socket, "-n", "k8s.io", "images", "import", archive).CombinedOutput()
	if err != nil {
		return fmt.Errorf("import %s: %v: %s", archive, err, out)
	}
	log.Printf("real node: imported %s in %.1f s", filepath.Base(archive), time.Since(started).Seconds())
	return nil
}

func (n *realNode) stop() {
	n.bridge.close()
	if n.netns != nil {
		_ = n.netns.Close()
	}
	cleanupRealNode(n.opts.root)
}

type nodeConfigs struct{ containerd, kubelet, kubeProxy, corefile string }

func (n *realNode) writeConfigs() (nodeConfigs, error) {
	r := n.opts
	run := filepath.Join(r.root, "run")
	c := nodeConfigs{
		containerd: filepath.Join(run, "containerd.toml"),
		kubelet:    filepath.Join(run, "kubelet.yaml"),
		kubeProxy:  filepath.Join(run, "kube-proxy.yaml"),
		corefile:   filepath.Join(run, "Corefile"),
	}
	cniConf := filepath.Join(run, "cni-conf")
	if err := os.MkdirAll(cniConf, 0o755); err != nil {
		return c, err
	}
	files := map[string]string{
		filepath.Join(cniConf, "10-rljob.conflist"): fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "rljob-real-node",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "%s"}]], "routes": [{"dst": "0.0.0.0/0"}],
              "dataDir": "%s"}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`, podSubnet, filepath.Join(run, "cni-ipam")),
		c.containerd: fmt.Sprintf(`version = 2
root = %q
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = %q

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  # root here has no CAP_SYS_RESOURCE: a negative oom_score_adj would make every runc create fail.
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = %q
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
    max_conf_num = 1
`, filepath.Join(run, "containerd-root"), n.socket, r.pauseImage, r.runc, r.cniBin, cniConf),
		c.kubelet: fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# Kubernetes >= 1.35 refuses cgroup v1 unless told otherwise; this machine has only v1.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /%s
containerRuntimeEndpoint: unix://%s
address: %s
port: %d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
tlsCertFile: %s
tlsPrivateKeyFile: %s
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true, cacheTTL: 10s}
  x509: {clientCAFile: %s}
authorization:
  mode: Webhook
  webhook: {cacheAuthorizedTTL: 10s, cacheUnauthorizedTTL: 5s}
clusterDNS: [%s]
clusterDomain: %s
resolvConf: %s
failSwapOn: false
# A shared CI disk is often fuller than kubelet's defaults tolerate; evict only when nearly out.
evictionHard: {memory.available: "100Mi", nodefs.available: "1%%", nodefs.inodesFree: "1%%", imagefs.available: "1%%"}
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
serializeImagePulls: false
maxPods: 110
podPidsLimit: -1
nodeStatusUpdateFrequency: 5s
syncFrequency: 10s
fileCheckFrequency: 20s
kubeAPIQPS: 50
kubeAPIBurst: 100
`, cgroupName, n.socket, nodeIPString, kubeletPort, n.pki.KubeletServingCert, n.pki.KubeletServingKey,
			n.caFile,
			nodeIPString, clusterDomain, filepath.Join(run, "resolv.conf")),
		filepath.Join(run, "resolv.conf"): "nameserver " + nodeIPString + "\n",
		c.kubeProxy: fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: %s
mode: iptables
hostnameOverride: %s
clusterCIDR: %s
bindAddress: %s
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
iptables:
  # SNAT Service traffic, so a pod can reach a Service whose backend sits on the same bridge.
  masqueradeAll: true
  minSyncPeriod: 0s
# conntrack sysctls cannot be set from inside a network namespace: leave them alone.
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
`, n.pki.KubeProxyKubeconfig, r.name, podCIDR, nodeIPString),
		c.corefile: fmt.Sprintf(`%s:53 in-addr.arpa:53 ip6.arpa:53 {
    bind %s
    errors
    health 127.0.0.1:18080
    ready 127.0.0.1:18181
    prometheus 127.0.0.1:19153
    kubernetes %s in-addr.arpa ip6.arpa {
        kubeconfig %s
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 5
    loadbalance
}
`, clusterDomain, nodeIPString, clusterDomain, n.pki.CoreDNSKubeconfig),
	}
	for p, data := range files {
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			return c, err
		}
	}
	return c, nil
}

// createNodeRBAC lets the apiserver use the kubelet API, CoreDNS read Services and endpoints, and
// kube-router read pods, namespaces and NetworkPolicies.
func createNodeRBAC(ctx context.Context, cs kubernetes.Interface) error {
	objects := []func() error{
		func() error {
			_, err := cs.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
				ObjectMeta: metav1.ObjectMeta{Name: "rljob:apiserver-kubelet-client"},
				RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "system:kubelet-api-admin"},
				Subjects:   []rbacv1.Subject{{APIGroup: "rbac.authorization.k8s.io", Kind: "User", Name: apiserverKubeletClientUser}},
			}, metav1.CreateOptions{})
			return err
		},
		func() error {
			_, err := cs.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{
				ObjectMeta: metav1.ObjectMeta{Name: "rljob:coredns"},
				Rules: []rbacv1.PolicyRule{
					{APIGroups: []string{""}, Resources: []string{"endpoints", "services", "pods", "namespaces"}, Verbs: []string{"list", "watch"}},
					{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: []string{"list", "watch"}},
				},
			}, metav1.CreateOptions{})
			return err
		},
		func() error {
			_, err := cs.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
				ObjectMeta: metav1.ObjectMeta{Name: "rljob:coredns"},
				RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "rljob:coredns"},
				Subjects:   []rbacv1.Subject{{APIGroup: "rbac.authorization.k8s.io", Kind: "User", Name: coreDNSUser}},
			}, metav1.CreateOptions{})
			return err
		},
		// kube-router starts informers on all of these, whichever of its controllers run.
		func() error {
			_, err := cs.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{
				ObjectMeta: metav1.ObjectMeta{Name: "rljob:kube-router"},
				Rules: []rbacv1.PolicyRule{
					{APIGroups: []string{""}, Resources: []string{"endpoints", "services", "pods", "namespaces", "nodes"}, Verbs: []string{"get", "list", "watch"}},
					{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: []string{"list", "watch"}},
					{APIGroups: []string{"networking.k8s.io"}, Resources: []string{"networkpolicies"}, Verbs: []string{"list", "watch"}},
				},
			}, metav1.CreateOptions{})
			return err
		},
		func() error {
			_, err := cs.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
				ObjectMeta: metav1.ObjectMeta{Name: "rljob:kube-router"},
				RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "rljob:kube-router"},
				Subjects:   []rbacv1.Subject{{APIGroup: "rbac.authorization.k8s.io", Kind: "User", Name: kubeRouterUser}},
			}, metav1.CreateOptions{})
			return err
		},
	}
	for _, create := range objects {
		if err := create(); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("node RBAC: %w", err)
		}
	}
	return nil
}

// createAPIServerEndpoints gives Service "kubernetes" an endpoint pods can reach: the apiserver
// bridge on the node IP. The apiserver runs with --endpoint-reconciler-type=none (its loopback
// address is not a valid endpoint), so nothing else would.
func createAPIServerEndpoints(ctx context.Context, cs kubernetes.Interface) error {
	ready := true
	port := int32(nodeAPIPort)
	name, proto := "https", corev1.ProtocolTCP
	_, err := cs.DiscoveryV1().EndpointSlices("default").Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "kubernetes", Labels: map[string]string{
			discoveryv1.LabelServiceName: "kubernetes",
			discoveryv1.LabelManagedBy:   "localkube.rljob.io",
		}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{nodeIPString}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}}},
		Ports:       []discoveryv1.EndpointPort{{Name: &name, Port: &port, Protocol: &proto}},
	}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("kubernetes EndpointSlice: %w", err)
	}
	return nil
}

// runNodeClean is "localkube node-clean": with the machine's real-node lock held (so a running
// node is never touched), remove whatever a killed one left behind.
func runNodeClean(args []string) int {
	log.SetFlags(log.Ltime)
	log.SetPrefix("localkube: ")
	fs := flag.NewFlagSet("localkube node-clean", flag.ContinueOnError)
	root := fs.String("real-node-root", defaultNodeRoot, "state folder of the real node")
	lockPath := fs.String("real-node-lock", defaultNodeLock, "machine-wide real-node lock")
	timeout := fs.Duration("timeout", 10*time.Minute, "how long to wait for a running real node to stop")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	lock, err := acquireNodeLock(*lockPath, *timeout, os.TempDir(), make(chan os.Signal))
	if err != nil {
		log.Print(err)
		return 1
	}
	defer lock.Close()
	cleanupRealNode(*root)
	log.Printf("real node state under %s and cgroups %s removed", *root, cgroupName)
	return 0
}
