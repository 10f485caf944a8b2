package store

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"time"
)

// The cluster's public-key infrastructure: one CA that signs etcd's server
// certificate (for clients and peers alike) and a client certificate per
// host, its common name the host's name, plus one for the administrator.
// Everything is ECDSA P-256, every file mode 0600 in a directory of mode
// 0700: the keys are the cluster's credentials.
const (
	CAFile     = "ca.crt"
	caKeyFile  = "ca.key"
	serverName = "server"
	// AdminName is the common name of the administrator's certificate:
	// etcd's superuser once authentication is enabled.
	AdminName = "root"

	caValidity = 10 * 365 * 24 * time.Hour
	// LeafValidity is how long server and client certificates last.
	LeafValidity = 2 * 365 * 24 * time.Hour
	// renewBefore: a server certificate this close to its end is issued
	// anew at start (the CA is at hand); a client certificate is warned of.
	renewBefore = 30 * 24 * time.Hour
)

// PKI is a cluster CA in a directory, with the certificates it issued there.
type PKI struct {
	Dir  string
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// EnsurePKI loads the CA in dir, or creates dir and a new CA when there is
// none. created reports the latter.
func EnsurePKI(dir string) (p *PKI, created bool, err error) {
	p, err = LoadPKI(dir)
	if err == nil || !errors.Is(err, fs.ErrNotExist) {
		return p, false, err
	}
	if _, err := os.Stat(filepath.Join(dir, caKeyFile)); err == nil {
		return nil, false, fmt.Errorf("%s exists without %s: restore it or remove both", filepath.Join(dir, caKeyFile), CAFile)
	}
	if err := privateDir(dir); err != nil {
		return nil, false, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, false, fmt.Errorf("generate CA key: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		Subject:               pkix.Name{CommonName: "skiff cluster CA", Organization: []string{"skiff"}},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(caValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := sign(tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, false, err
	}
	cert, _ := x509.ParseCertificate(der)
	p = &PKI{Dir: dir, cert: cert, key: key}
	if err := writePair(filepath.Join(dir, CAFile), filepath.Join(dir, caKeyFile), der, key); err != nil {
		return nil, false, err
	}
	return p, true, nil
}

// LoadPKI loads the CA certificate and key in dir (to issue certificates).
func LoadPKI(dir string) (*PKI, error) {
	certFile, keyFile := filepath.Join(dir, CAFile), filepath.Join(dir, caKeyFile)
	cert, err := readCert(certFile)
	if err != nil {
		return nil, err
	}
	key, err := readKey(keyFile)
	if err != nil {
		return nil, err
	}
	if !cert.IsCA || !key.PublicKey.Equal(cert.PublicKey) {
		return nil, fmt.Errorf("%s is not the CA certificate of key %s", certFile, keyFile)
	}
	return &PKI{Dir: dir, cert: cert, key: key}, nil
}

// Files are where the certificate and key of name lie in dir.
func Files(dir, name string) (certFile, keyFile string) {
	return filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key")
}

// ClientTLS is what a client with the certificate of name uses, when that
// certificate is in the PKI's directory.
func (p *PKI) ClientTLS(name string) TLS {
	cert, key := Files(p.Dir, name)
	return TLS{CAFile: filepath.Join(p.Dir, CAFile), CertFile: cert, KeyFile: key}
}

// EnsureClient returns the client certificate of name in the PKI's
// directory, issuing it when it is missing, expires within 30 days or was
// issued by another CA. issued reports a new certificate.
func (p *PKI) EnsureClient(name string) (t TLS, issued bool, err error) {
	return p.ensure(name, false, nil)
}

// EnsureServer returns etcd's server certificate, issued for hosts (IP
// addresses or DNS names) when it is missing, expires within 30 days or was
// issued by another CA. A certificate in place that does not cover every
// host is kept (an operator may have put it there) and missing names the
// hosts it lacks.
func (p *PKI) EnsureServer(hosts []string) (t TLS, issued bool, missing []string, err error) {
	t, issued, err = p.ensure(serverName, true, hosts)
	if err != nil || issued {
		return t, issued, nil, err
	}
	cert, err := readCert(t.CertFile)
	if err != nil {
		return t, false, nil, err
	}
	for _, h := range hosts {
		if cert.VerifyHostname(h) != nil {
			missing = append(missing, h)
		}
	}
	return t, false, missing, nil
}

func (p *PKI) ensure(name string, server bool, hosts []string) (TLS, bool, error) {
	t := p.ClientTLS(name)
	if cert, err := readCert(t.CertFile); err == nil && time.Until(cert.NotAfter) > renewBefore && cert.CheckSignatureFrom(p.cert) == nil {
		if _, err := readKey(t.KeyFile); err == nil {
			return t, false, nil
		}
	}
	now := time.Now()
	t, err := p.Issue(name, server, hosts, p.Dir, now.Add(-time.Hour), now.Add(LeafValidity))
	return t, err == nil, err
}

// Issue signs a new certificate with common name name, valid from notBefore
// to notAfter, and writes it with its key to dir as name.crt and name.key,
// with a copy of the CA certificate when dir is not the PKI's. A server
// certificate carries hosts as its subject alternative names and serves as
// a client too (etcd peers and etcd's own gateway dial with it).
func (p *PKI) Issue(name string, server bool, hosts []string, dir string, notBefore, notAfter time.Time) (TLS, error) {
	if name == "" || filepath.Base(name) != name || name == "ca" {
		return TLS{}, fmt.Errorf("certificate name %q: use a host name", name)
	}
	if err := privateDir(dir); err != nil {
		return TLS{}, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return TLS{}, fmt.Errorf("generate key for %s: %w", name, err)
	}
	tmpl := &x509.Certificate{
		Subject:     pkix.Name{CommonName: name, Organization: []string{"skiff"}},
		NotBefore:   notBefore,
		NotAfter:    notAfter,
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if server {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
		for _, h := range hosts {
			if ip := net.ParseIP(h); ip != nil {
				tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
			} else if !slices.Contains(tmpl.DNSNames, h) {
				tmpl.DNSNames = append(tmpl.DNSNames, h)
			}
		}
	}
	der, err := sign(tmpl, p.cert, &key.PublicKey, p.key)
	if err != nil {
		return TLS{}, err
	}
	t := TLS{CAFile: filepath.Join(dir, CAFile)}
	t.CertFile, t.KeyFile = Files(dir, name)
	if err := writePair(t.CertFile, t.KeyFile, der, key); err != nil {
		return TLS{}, err
	}
	if filepath.Clean(dir) != filepath.Clean(p.Dir) {
		if err := writePrivate(t.CAFile, pemCert(p.cert.Raw)); err != nil {
			return TLS{}, err
		}
	}
	return t, nil
}

func sign(tmpl, parent *x509.Certificate, pub, signer any) ([]byte, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("certificate serial: %w", err)
	}
	tmpl.SerialNumber = serial
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, pub, signer)
	if err != nil {
		return nil, fmt.Errorf("sign certificate %q: %w", tmpl.Subject.CommonName, err)
	}
	return der, nil
}

// privateDir creates dir with mode 0700, or makes an existing one so.
func privateDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("certificate directory: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return fmt.Errorf("certificate directory: %w", err)
	}
	return nil
}

func writePair(certFile, keyFile string, der []byte, key *ecdsa.PrivateKey) error {
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return fmt.Errorf("encode key %s: %w", keyFile, err)
	}
	if err := writePrivate(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})); err != nil {
		return err
	}
	return writePrivate(certFile, pemCert(der))
}

func pemCert(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

// writePrivate replaces file with data, mode 0600, never leaving a partly
// written file behind.
func writePrivate(file string, data []byte) error {
	tmp := file + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return fmt.Errorf("write %s: %w", file, err)
	}
	if err := os.Chmod(tmp, 0o600); err != nil { // a stale tmp file keeps its mode
		return fmt.Errorf("write %s: %w", file, err)
	}
	if err := os.Rename(tmp, file); err != nil {
		return fmt.Errorf("write %s: %w", file, err)
	}
	return nil
}

func readCert(file string) (*x509.Certificate, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("certificate: %w", err)
	}
	b, _ := pem.Decode(data)
	if b == nil || b.Type != "CERTIFICATE" {
		return nil, fmt.Errorf("certificate %s: no PEM certificate in it", file)
	}
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		return nil, fmt.Errorf("certificate %s: %w", file, err)
	}
	return cert, nil
}

func readKey(file string) (*ecdsa.PrivateKey, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("key: %w", err)
	}
	b, _ := pem.Decode(data)
	if b == nil {
		return nil, fmt.Errorf("key %s: no PEM key in it", file)
	}
	key, err := x509.ParseECPrivateKey(b.Bytes)
	if err != nil {
		return nil, fmt.Errorf("key %s: %w", file, err)
	}
	return key, nil
}
