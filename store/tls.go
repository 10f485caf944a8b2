package store

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"
)

// TLS is how a client reaches the store: the CA that signed etcd's server
// certificate and this client's certificate and key (etcd's --cacert,
// --cert, --key), or, with Insecure, plain HTTP without authentication.
type TLS struct {
	CAFile, CertFile, KeyFile string
	Insecure                  bool
	serverName                string // the name to check the server's certificate for, if not its address's
}

// config loads the files. Every error names the file at fault: a client
// that cannot authenticate must say so at start, not hang in retries.
func (t TLS) config() (*tls.Config, error) {
	if t.Insecure {
		if t.CAFile != "" || t.CertFile != "" || t.KeyFile != "" {
			return nil, errors.New("etcd TLS files given together with --etcd-insecure: choose one")
		}
		return nil, nil
	}
	if t.CAFile == "" || t.CertFile == "" || t.KeyFile == "" {
		return nil, errors.New("the cluster store needs TLS: give --etcd-cafile, --etcd-certfile and --etcd-keyfile (or --etcd-insecure for plain HTTP)")
	}
	roots, err := readCAs(t.CAFile)
	if err != nil {
		return nil, err
	}
	if _, err := readKey(t.KeyFile); err != nil {
		return nil, fmt.Errorf("etcd client %w", err)
	}
	pair, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("etcd client certificate %s with key %s: %w", t.CertFile, t.KeyFile, err)
	}
	cert := pair.Leaf
	if now := time.Now(); now.After(cert.NotAfter) {
		return nil, fmt.Errorf("etcd client certificate %s expired at %s", t.CertFile, cert.NotAfter.Format(time.RFC3339))
	} else if now.Before(cert.NotBefore) {
		return nil, fmt.Errorf("etcd client certificate %s is not valid before %s", t.CertFile, cert.NotBefore.Format(time.RFC3339))
	}
	if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		return nil, fmt.Errorf("etcd client certificate %s is not one a CA in %s issued for clients: %w", t.CertFile, t.CAFile, err)
	}
	return &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12, ServerName: t.serverName}, nil
}

// readCAs reads a CA file, which may hold several certificates (a bundle).
func readCAs(file string) (*x509.CertPool, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("etcd CA certificate: %w", err)
	}
	roots, n := x509.NewCertPool(), 0
	for b, rest := pem.Decode(data); b != nil; b, rest = pem.Decode(rest) {
		if b.Type != "CERTIFICATE" {
			continue
		}
		ca, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("etcd CA certificate %s: %w", file, err)
		}
		if time.Now().After(ca.NotAfter) {
			return nil, fmt.Errorf("etcd CA certificate %s expired at %s", file, ca.NotAfter.Format(time.RFC3339))
		}
		roots.AddCert(ca)
		n++
	}
	if n == 0 {
		return nil, fmt.Errorf("etcd CA certificate %s: no PEM certificate in it", file)
	}
	return roots, nil
}

// CommonName is the common name of the client certificate: the host (or
// the administrator) the store knows this client as.
func (t TLS) CommonName() (string, error) {
	if t.Insecure {
		return "", nil
	}
	cert, err := readCert(t.CertFile)
	if err != nil {
		return "", fmt.Errorf("etcd client %w", err)
	}
	return cert.Subject.CommonName, nil
}

// ExpiresSoon reports when the client certificate ends if that is within 30
// days (zero otherwise), so an agent can warn before it is locked out.
func (t TLS) ExpiresSoon() time.Time {
	if cert, err := readCert(t.CertFile); err == nil && time.Until(cert.NotAfter) < renewBefore {
		return cert.NotAfter
	}
	return time.Time{}
}

// checkSchemes refuses endpoints whose scheme does not match t: a TLS
// client would otherwise send its handshake to a plain server, or a plain
// client its requests to a TLS one, and both wait for answers that never
// come.
func (t TLS) checkSchemes(endpoints []string) error {
	want := "https"
	if t.Insecure {
		want = "http"
	}
	for _, ep := range endpoints {
		u, err := url.Parse(ep)
		if err != nil || u.Host == "" {
			return fmt.Errorf("etcd endpoint %q: want %s://HOST:PORT", ep, want)
		}
		if u.Scheme != want {
			if t.Insecure {
				return fmt.Errorf("etcd endpoint %s is not plain HTTP, but --etcd-insecure is given", ep)
			}
			return fmt.Errorf("etcd endpoint %s is plain HTTP: the store is reached over TLS (https://), or give --etcd-insecure", ep)
		}
	}
	return nil
}

// probe makes one TLS connection to each endpoint in turn and explains a
// failed handshake in terms of the files (the etcd client only retries
// until its deadline and says "context deadline exceeded"). Endpoints that
// cannot be reached at all say nothing about the files: probe returns nil
// unless a handshake failed.
func (t TLS) probe(ctx context.Context, endpoints []string, cfg *tls.Config, dial Dialer) error {
	tr := &http.Transport{TLSClientConfig: cfg, DisableKeepAlives: true}
	if dial != nil {
		tr.DialContext = func(ctx context.Context, _, addr string) (net.Conn, error) { return dial(ctx, addr) }
	}
	client := &http.Client{Transport: tr, Timeout: 2 * time.Second}
	defer client.CloseIdleConnections()
	for _, ep := range endpoints {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(ep, "/")+"/health", nil)
		if err != nil {
			return fmt.Errorf("etcd endpoint %s: %w", ep, err)
		}
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
			return nil
		}
		if err := t.explain(ep, err); err != nil {
			return err
		}
	}
	return nil
}

// explain turns a TLS failure reaching ep into an error naming the file at
// fault, and returns nil for failures that are not TLS's.
func (t TLS) explain(ep string, err error) error {
	var unknown x509.UnknownAuthorityError
	var host x509.HostnameError
	var invalid x509.CertificateInvalidError
	switch {
	case errors.As(err, &unknown):
		return fmt.Errorf("etcd at %s presents a certificate the CA in %s did not issue (another cluster's, or the wrong --etcd-cafile): %w", ep, t.CAFile, err)
	case errors.As(err, &host):
		return fmt.Errorf("etcd at %s presents a certificate for another host (%s); issue its server certificate for this address, or reach it by a name the certificate has (CA %s): %w", ep, host.Host, t.CAFile, err)
	case errors.As(err, &invalid) && invalid.Reason == x509.Expired:
		return fmt.Errorf("etcd at %s presents an expired certificate: %w", ep, err)
	case errors.As(err, &invalid):
		return fmt.Errorf("etcd at %s presents a certificate the CA in %s does not accept: %w", ep, t.CAFile, err)
	case strings.Contains(err.Error(), "remote error: tls:"):
		// The server's alert: it refused our certificate (TLS 1.3 tells
		// the client only on its first read after the handshake).
		return fmt.Errorf("etcd at %s refused the client certificate %s (not issued by the cluster's CA, or expired): %w", ep, t.CertFile, err)
	case strings.Contains(err.Error(), "server gave HTTP response"), strings.Contains(err.Error(), "first record does not look like a TLS handshake"):
		return fmt.Errorf("etcd at %s serves plain HTTP, not TLS (was it started with --etcd-insecure?): %w", ep, err)
	}
	return nil
}
