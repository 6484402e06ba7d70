package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// pkiFiles are the PEM files of a throwaway cluster PKI. ECDSA P-256 keeps generation instant on
// a loaded 2-core machine; kube-apiserver accepts it for serving, client and service-account keys.
type pkiFiles struct {
	CACert, CAKey       string
	ServingCert         string
	ServingKey          string
	AdminCert, AdminKey string
	SAKey, SAPub        string
}

type keyPair struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// writePKI creates a CA, an apiserver serving certificate valid for loopback names only, an
// admin client certificate in group system:masters, and a service-account signing key.
func writePKI(dir string) (pkiFiles, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return pkiFiles{}, err
	}
	f := pkiFiles{
		CACert: filepath.Join(dir, "ca.crt"), CAKey: filepath.Join(dir, "ca.key"),
		ServingCert: filepath.Join(dir, "apiserver.crt"), ServingKey: filepath.Join(dir, "apiserver.key"),
		AdminCert: filepath.Join(dir, "admin.crt"), AdminKey: filepath.Join(dir, "admin.key"),
		SAKey: filepath.Join(dir, "sa.key"), SAPub: filepath.Join(dir, "sa.pub"),
	}
	now := time.Now().Add(-time.Hour) // tolerate small clock differences between processes
	ca, err := newKeyPair(&x509.Certificate{
		Subject:               pkix.Name{CommonName: "localkube-ca"},
		NotBefore:             now,
		NotAfter:              now.AddDate(1, 0, 0),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
	}, nil)
	if err != nil {
		return f, err
	}
	serving, err := newKeyPair(&x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-apiserver"},
		NotBefore:   now,
		NotAfter:    now.AddDate(1, 0, 0),
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames: []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
			"kubernetes.default.svc.cluster.local"},
		// 10.96.0.1 is the in-cluster "kubernetes" Service IP; nothing ever routes to it here.
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("::1"), net.ParseIP("10.96.0.1")},
	}, &ca)
	if err != nil {
		return f, err
	}
	admin, err := newKeyPair(&x509.Certificate{
		Subject:     pkix.Name{CommonName: "localkube-admin", Organization: []string{"system:masters"}},
		NotBefore:   now,
		NotAfter:    now.AddDate(1, 0, 0),
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}, &ca)
	if err != nil {
		return f, err
	}
	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return f, err
	}
	saPub, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return f, err
	}
	for _, w := range []struct {
		path string
		data []byte
	}{
		{f.CACert, certPEM(ca.cert)}, {f.CAKey, keyPEM(ca.key)},
		{f.ServingCert, certPEM(serving.cert)}, {f.ServingKey, keyPEM(serving.key)},
		{f.AdminCert, certPEM(admin.cert)}, {f.AdminKey, keyPEM(admin.key)},
		{f.SAKey, keyPEM(saKey)}, {f.SAPub, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: saPub})},
	} {
		if err := os.WriteFile(w.path, w.data, 0o600); err != nil {
			return f, err
		}
	}
	return f, nil
}

// newKeyPair signs template with parent, or self-signs it when parent is nil.
func newKeyPair(template *x509.Certificate, parent *keyPair) (keyPair, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return keyPair{}, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return keyPair{}, err
	}
	template.SerialNumber = serial
	signerCert, signerKey := template, key
	if parent != nil {
		signerCert, signerKey = parent.cert, parent.key
	}
	der, err := x509.CreateCertificate(rand.Reader, template, signerCert, &key.PublicKey, signerKey)
	if err != nil {
		return keyPair{}, fmt.Errorf("sign %s: %w", template.Subject.CommonName, err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return keyPair{}, err
	}
	return keyPair{cert: cert, key: key}, nil
}

func certPEM(c *x509.Certificate) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})
}

func keyPEM(k *ecdsa.PrivateKey) []byte {
	der, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		// Only fails for curves x509 does not know; P-256 always marshals.
		panic(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
}
