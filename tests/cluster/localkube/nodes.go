package main

import (
	"context"
	"fmt"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
)

// kwokAnnotation marks nodes kwok manages (kwok runs with this annotation selector).
const kwokAnnotation = "kwok.x-k8s.io/node"

// nodePool describes a group of identical fake nodes.
type nodePool struct {
	prefix string
	count  int
	// gpuResource is the extended resource name ("nvidia.com/gpu"); empty for CPU nodes.
	gpuResource string
	gpus        int
	labels      map[string]string
	// taint keeps pods that do not tolerate the GPU resource off the pool.
	taint bool
}

// nodePools returns the NVIDIA, AMD and CPU pools with the labels the vendors' node labellers
// set (NVIDIA GPU Feature Discovery, ROCm node labeller) plus rljob's own accelerator label.
func nodePools(o upOptions) []nodePool {
	return []nodePool{
		{prefix: "nv", count: o.nvidiaNodes, gpuResource: "nvidia.com/gpu", gpus: o.gpusPerNode, taint: o.taintGPUNodes, labels: map[string]string{
			"nvidia.com/gpu.present": "true",
			"nvidia.com/gpu.product": o.nvidiaProduct,
			"nvidia.com/gpu.count":   strconv.Itoa(o.gpusPerNode),
			"rljob.io/accelerator":   "nvidia",
		}},
		{prefix: "amd", count: o.amdNodes, gpuResource: "amd.com/gpu", gpus: o.gpusPerNode, taint: o.taintGPUNodes, labels: map[string]string{
			"amd.com/gpu.present":      "true",
			"amd.com/gpu.product-name": o.amdProduct,
			"amd.com/gpu.family":       "AI",
			"rljob.io/accelerator":     "amd",
		}},
		{prefix: "cpu", count: o.cpuNodes, labels: map[string]string{}},
	}
}

// fakeNodes builds the Node objects for all pools. Status is accepted on create, which is how a
// node gets its capacity without a kubelet; kwok then keeps it Ready and leaves capacity alone.
func fakeNodes(pools []nodePool) []*corev1.Node {
	var nodes []*corev1.Node
	for _, p := range pools {
		for i := 0; i < p.count; i++ {
			name := fmt.Sprintf("%s-%d", p.prefix, i)
			labels := map[string]string{
				"type":                   "kwok",
				"kubernetes.io/hostname": name,
				"kubernetes.io/os":       "linux",
				"kubernetes.io/arch":     "amd64",
			}
			for k, v := range p.labels {
				labels[k] = v
			}
			capacity := corev1.ResourceList{
				corev1.ResourceCPU:    resource.MustParse("64"),
				corev1.ResourceMemory: resource.MustParse("1Ti"),
				corev1.ResourcePods:   resource.MustParse("110"),
			}
			if p.gpuResource != "" {
				capacity[corev1.ResourceName(p.gpuResource)] = *resource.NewQuantity(int64(p.gpus), resource.DecimalSI)
			}
			node := &corev1.Node{
				ObjectMeta: metav1.ObjectMeta{
					Name:        name,
					Labels:      labels,
					Annotations: map[string]string{kwokAnnotation: "fake"},
				},
				Status: corev1.NodeStatus{Capacity: capacity, Allocatable: capacity.DeepCopy()},
			}
			if p.taint {
				node.Spec.Taints = []corev1.Taint{{Key: p.gpuResource, Value: "present", Effect: corev1.TaintEffectNoSchedule}}
			}
			nodes = append(nodes, node)
		}
	}
	return nodes
}

// createNodes creates the nodes, tolerating ones left from an earlier run in the same etcd.
func createNodes(ctx context.Context, cs kubernetes.Interface, nodes []*corev1.Node) error {
	for _, n := range nodes {
		if _, err := cs.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create node %s: %w", n.Name, err)
		}
	}
	return nil
}

// waitNodesReady waits until every named node reports Ready=True (set by kwok's node stages).
func waitNodesReady(ctx context.Context, cs kubernetes.Interface, names []string, timeout time.Duration) error {
	return wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		for _, name := range names {
			n, err := cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
			if err != nil || !nodeReady(n) {
				return false, nil
			}
		}
		return true, nil
	})
}

func nodeReady(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
