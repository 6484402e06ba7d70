package main

import (
	"fmt"
	"net/url"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

// startEtcd runs a single-member etcd inside this process, on loopback only, and waits until it
// serves. Data is throwaway, so fsync is off: it dominates etcd latency on a busy CI disk.
func startEtcd(dataDir, logFile string, clientPort, peerPort int) (*embed.Etcd, string, error) {
	client := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", clientPort)}
	peer := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", peerPort)}
	cfg := embed.NewConfig()
	cfg.Name = "localkube"
	cfg.Dir = dataDir
	cfg.ListenClientUrls = []url.URL{client}
	cfg.AdvertiseClientUrls = []url.URL{client}
	cfg.ListenPeerUrls = []url.URL{peer}
	cfg.AdvertisePeerUrls = []url.URL{peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.UnsafeNoFsync = true
	cfg.LogLevel = "warn"
	cfg.LogOutputs = []string{logFile}
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, "", fmt.Errorf("start etcd: %w", err)
	}
	select {
	case <-e.Server.ReadyNotify():
		return e, client.String(), nil
	case err := <-e.Err():
		e.Close()
		return nil, "", fmt.Errorf("etcd failed: %w", err)
	case <-time.After(60 * time.Second):
		e.Close()
		return nil, "", fmt.Errorf("etcd not ready after 60s (see %s)", logFile)
	}
}
