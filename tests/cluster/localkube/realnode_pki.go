package main

import (
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"net"
	"os"
	"path/filepath"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// nodePKI are the real node's credentials, all signed by the cluster CA:
//   - the kubelet's serving certificate (the apiserver verifies it: --kubelet-certificate-authority);
//   - the kubelet's client certificate (system:node:<name> in system:nodes, for the Node authorizer);
//   - the apiserver's client certificate for the kubelet API (the kubelet authenticates it by
//     x509 and authorises it by SubjectAccessReview: no anonymous access, even on loopback);
//   - kube-proxy's (system:kube-proxy, bound by the default system:node-proxier binding), CoreDNS's
//     and kube-router's client certificates.
type nodePKI struct {
	KubeletServingCert, KubeletServingKey string
	APIServerKubeletCert                  string
	APIServerKubeletKey                   string
	KubeletKubeconfig                     string
	KubeProxyKubeconfig                   string
	CoreDNSKubeconfig                     string
	KubeRouterKubeconfig                  string
}

// Identities of the node components (RBAC subjects).
const (
	apiserverKubeletClientUser = "kube-apiserver-kubelet-client"
	coreDNSUser                = "system:rljob-coredns"
	kubeRouterUser             = "system:rljob-kube-router"
)

func loadCA(pki pkiFiles) (keyPair, error) {
	certPEMBytes, err := os.ReadFile(pki.CACert)
	if err != nil {
		return keyPair{}, err
	}
	keyPEMBytes, err := os.ReadFile(pki.CAKey)
	if err != nil {
		return keyPair{}, err
	}
	cb, _ := pem.Decode(certPEMBytes)
	kb, _ := pem.Decode(keyPEMBytes)
	if cb == nil || kb == nil {
		return keyPair{}, errors.New("cannot decode the cluster CA")
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return keyPair{}, err
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		return keyPair{}, err
	}
	return keyPair{cert: cert, key: key}, nil
}

// writeNodePKI writes the node's certificates and kubeconfigs into dir. server is the apiserver
// URL as the node components see it (inside the node's network namespace).
func writeNodePKI(dir string, pki pkiFiles, nodeName string, nodeIP net.IP, server string) (nodePKI, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nodePKI{}, err
	}
	ca, err := loadCA(pki)
	if err != nil {
		return nodePKI{}, err
	}
	caPEM := certPEM(ca.cert)
	now := time.Now().Add(-time.Hour)
	client := func(cn string, orgs ...string) (keyPair, error) {
		return newKeyPair(&x509.Certificate{
			Subject:     pkix.Name{CommonName: cn, Organization: orgs},
			NotBefore:   now,
			NotAfter:    now.AddDate(1, 0, 0),
			KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		}, &ca)
	}
	nodeUser := "system:node:" + nodeName
	serving, err := newKeyPair(&x509.Certificate{
		Subject:     pkix.Name{CommonName: nodeUser, Organization: []string{"system:nodes"}},
		NotBefore:   now,
		NotAfter:    now.AddDate(1, 0, 0),
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:    []string{nodeName, "localhost"},
		IPAddresses: []net.IP{nodeIP, net.ParseIP("127.0.0.1")},
	}, &ca)
	if err != nil {
		return nodePKI{}, err
	}
	kubelet, err := client(nodeUser, "system:nodes")
	if err != nil {
		return nodePKI{}, err
	}
	apiserverClient, err := client(apiserverKubeletClientUser)
	if err != nil {
		return nodePKI{}, err
	}
	proxy, err := client("system:kube-proxy")
	if err != nil {
		return nodePKI{}, err
	}
	dns, err := client(coreDNSUser)
	if err != nil {
		return nodePKI{}, err
	}
	router, err := client(kubeRouterUser)
	if err != nil {
		return nodePKI{}, err
	}
	p := nodePKI{
		KubeletServingCert:   filepath.Join(dir, "kubelet-serving.crt"),
		KubeletServingKey:    filepath.Join(dir, "kubelet-serving.key"),
		APIServerKubeletCert: filepath.Join(dir, "apiserver-kubelet-client.crt"),
		APIServerKubeletKey:  filepath.Join(dir, "apiserver-kubelet-client.key"),
		KubeletKubeconfig:    filepath.Join(dir, "kubelet.kubeconfig"),
		KubeProxyKubeconfig:  filepath.Join(dir, "kube-proxy.kubeconfig"),
		CoreDNSKubeconfig:    filepath.Join(dir, "coredns.kubeconfig"),
		KubeRouterKubeconfig: filepath.Join(dir, "kube-router.kubeconfig"),
	}
	for _, w := range []struct {
		path string
		data []byte
	}{
		{p.KubeletServingCert, certPEM(serving.cert)}, {p.KubeletServingKey, keyPEM(serving.key)},
		{p.APIServerKubeletCert, certPEM(apiserverClient.cert)}, {p.APIServerKubeletKey, keyPEM(apiserverClient.key)},
	} {
		if err := os.WriteFile(w.path, w.data, 0o600); err != nil {
			return p, err
		}
	}
	for _, k := range []struct {
		path string
		kp   keyPair
	}{{p.KubeletKubeconfig, kubelet}, {p.KubeProxyKubeconfig, proxy}, {p.CoreDNSKubeconfig, dns}, {p.KubeRouterKubeconfig, router}} {
		if err := writeClientKubeconfig(k.path, server, caPEM, k.kp); err != nil {
			return p, err
		}
	}
	return p, nil
}

func writeClientKubeconfig(path, server string, caPEM []byte, kp keyPair) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["localkube"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: caPEM}
	cfg.AuthInfos["node"] = &clientcmdapi.AuthInfo{ClientCertificateData: certPEM(kp.cert), ClientKeyData: keyPEM(kp.key)}
	cfg.Contexts["localkube"] = &clientcmdapi.Context{Cluster: "localkube", AuthInfo: "node"}
	cfg.CurrentContext = "localkube"
	return clientcmd.WriteToFile(*cfg, path)
}
