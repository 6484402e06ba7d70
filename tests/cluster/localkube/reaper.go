package main

import (
	"context"
	"log"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
)

// runPodReaper does a kubelet's last step of pod deletion for pods on kwok's fake nodes: once a
// pod has a deletionTimestamp, delete it for good with grace 0, preconditioned on its uid.
//
// It replaces kwok's own pod-delete stage, which deletes by name only (kwok v0.8.0,
// pkg/kwok/controllers/pod_controller.go: `Delete(ctx, pod.Name, NewDeleteOptions(0))`). A
// StatefulSet recreates a deleted pod under the same name within milliseconds, so kwok acting on
// a stale event of the old pod deleted the replacement too: two losses of one replica, which a
// real cluster never shows, since the kubelet deletes with `Preconditions: NewUIDPreconditions`
// (kubernetes v1.36 pkg/kubelet/status/status_manager.go). A precondition failure here means the
// pod of that name is already another one, which is left alone.
//
// It runs until ctx ends; it returns once its watches have synced.
func runPodReaper(ctx context.Context, kubeconfig string) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	factory := informers.NewSharedInformerFactory(cs, 0)
	pods := factory.Core().V1().Pods().Informer()
	nodes := factory.Core().V1().Nodes().Lister()
	fake := func(name string) bool {
		node, err := nodes.Get(name)
		if apierrors.IsNotFound(err) { // a node newer than the watch's view
			node, err = cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		}
		return err == nil && node.Annotations[kwokAnnotation] == "fake"
	}
	reap := func(obj any) {
		pod, ok := obj.(*corev1.Pod)
		if !ok || pod.DeletionTimestamp == nil || pod.Spec.NodeName == "" || !fake(pod.Spec.NodeName) {
			return // not being deleted, never bound, or on the real node, whose kubelet deletes it
		}
		opts := metav1.DeleteOptions{GracePeriodSeconds: new(int64), Preconditions: metav1.NewUIDPreconditions(string(pod.UID))}
		// Retried as kwok retries a failed stage: a busy API server must not leave a pod Terminating.
		backoff := wait.Backoff{Duration: 100 * time.Millisecond, Factor: 2, Steps: 8, Cap: 5 * time.Second}
		err := wait.ExponentialBackoffWithContext(ctx, backoff, func(ctx context.Context) (bool, error) {
			err := cs.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, opts)
			return err == nil || apierrors.IsNotFound(err) || apierrors.IsConflict(err), nil
		})
		if err != nil && ctx.Err() == nil {
			log.Printf("pod reaper: could not delete %s/%s (uid %s): %v", pod.Namespace, pod.Name, pod.UID, err)
		}
	}
	// Each pod in its own goroutine: one slow delete must not hold up the others' events.
	handle := func(obj any) { go reap(obj) }
	if _, err := pods.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    handle,
		UpdateFunc: func(_, obj any) { handle(obj) },
	}); err != nil {
		return err
	}
	factory.Start(ctx.Done())
	factory.WaitForCacheSync(ctx.Done())
	return nil
}
