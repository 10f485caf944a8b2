package store

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	"go.etcd.io/etcd/server/v3/embed"
)

// EmbeddedConfig describes an embedded etcd server.
type EmbeddedConfig struct {
	Dir       string // etcd's data
	ClientURL string // e.g. https://127.0.0.1:2379
	PeerURL   string // e.g. https://127.0.0.1:2380
	// PKIDir holds the cluster CA and the server's and clients'
	// certificates (default: Dir/pki). What is missing there is created at
	// start; what is there is reused.
	PKIDir string
	// Insecure serves clients and peers plain HTTP without authentication.
	Insecure bool
	Log      *slog.Logger // default slog.Default()
	// Name is this member's name (default "skiff").
	Name string
	// InitialCluster lists every member of a cluster as etcd's
	// --initial-cluster does (NAME=PEER-URL,...), this member included
	// (default: this member alone). etcd reads it only on a first start.
	InitialCluster string
	// Join starts a member that an existing cluster already lists (etcdctl
	// member add) rather than forming a new cluster: etcd's
	// --initial-cluster-state existing.
	Join bool
}

// Embedded is an etcd server running inside this process: the real server as
// a library, so one machine needs nothing else installed.
type Embedded struct {
	etcd  *embed.Etcd
	URL   string
	PKI   *PKI // nil when insecure
	close sync.Once
	// CreatedPKI reports that this start created the cluster CA.
	CreatedPKI bool
	adminURL   string // where the administrator reaches it
	serverName string // and what name of its certificate it checks
}

// StartEmbedded runs an etcd member, of a cluster of its own unless cfg
// names the others. By default it serves clients and peers over TLS and asks
// them for a certificate of the cluster CA, which it creates in cfg.PKIDir
// on first start (the members of one cluster need the same CA there: copy
// ca.crt and ca.key before their first start). It returns once the server
// is ready to serve: for a member of several, once a majority of them runs.
func StartEmbedded(ctx context.Context, cfg EmbeddedConfig) (*Embedded, error) {
	log := cfg.Log
	if log == nil {
		log = slog.Default()
	}
	cu, err := url.Parse(cfg.ClientURL)
	if err != nil {
		return nil, fmt.Errorf("etcd client URL %q: %w", cfg.ClientURL, err)
	}
	pu, err := url.Parse(cfg.PeerURL)
	if err != nil {
		return nil, fmt.Errorf("etcd peer URL %q: %w", cfg.PeerURL, err)
	}
	scheme := "https"
	if cfg.Insecure {
		scheme = "http"
	}
	for _, u := range []*url.URL{cu, pu} {
		if u.Scheme != scheme || u.Port() == "" {
			return nil, fmt.Errorf("embedded etcd URL %s: want %s://HOST:PORT (TLS unless --etcd-insecure)", u, scheme)
		}
	}
	ec := embed.NewConfig()
	ec.Name = cfg.Name
	if ec.Name == "" {
		ec.Name = "skiff"
	}
	ec.Dir = cfg.Dir
	ec.LogLevel = "error"
	ec.ListenClientUrls, ec.AdvertiseClientUrls = []url.URL{*cu}, []url.URL{*cu}
	ec.ListenPeerUrls, ec.AdvertisePeerUrls = []url.URL{*pu}, []url.URL{*pu}
	ec.InitialCluster = ec.Name + "=" + pu.String()
	if cfg.InitialCluster != "" {
		ec.InitialCluster = cfg.InitialCluster
	}
	if cfg.Join {
		ec.ClusterState = embed.ClusterStateFlagExisting
	}
	e := &Embedded{URL: cu.String()}
	if cfg.Insecure {
		log.Warn("the cluster store serves plain HTTP without authentication (--etcd-insecure): whoever reaches it can read and rewrite the cluster", "url", cu.String())
	} else {
		if cfg.PKIDir == "" {
			cfg.PKIDir = filepath.Join(cfg.Dir, "pki")
		}
		server, err := e.ensurePKI(cfg.PKIDir, serverHosts(cu, pu), log)
		if err != nil {
			return nil, err
		}
		info := transport.TLSInfo{CertFile: server.CertFile, KeyFile: server.KeyFile, TrustedCAFile: server.CAFile, ClientCertAuth: true}
		ec.ClientTLSInfo, ec.PeerTLSInfo = info, info
		// With TLS on one port for gRPC and HTTP, etcd serves gRPC through
		// net/http (grpc.Server.ServeHTTP), which made every request slower
		// (a CNI ADD 1.24x plain HTTP's). A listener of its own for HTTP
		// (health, metrics, the JSON gateway), on loopback, leaves the client
		// URL to the native gRPC server.
		ec.ListenClientHttpUrls = []url.URL{{Scheme: "https", Host: "127.0.0.1:0"}}
	}
	if e.etcd, err = embed.StartEtcd(ec); err != nil {
		return nil, fmt.Errorf("start embedded etcd in %s: %w", cfg.Dir, err)
	}
	select {
	case <-e.etcd.Server.ReadyNotify():
		if err := e.enableAuth(ctx, cu); err != nil {
			e.etcd.Close()
			return nil, err
		}
		return e, nil
	case err := <-e.etcd.Err():
		e.etcd.Close()
		return nil, fmt.Errorf("embedded etcd: %w", err)
	case <-time.After(30 * time.Second):
		e.etcd.Close()
		return nil, fmt.Errorf("embedded etcd in %s not ready after 30s", cfg.Dir)
	case <-ctx.Done():
		e.etcd.Close()
		return nil, ctx.Err()
	}
}

// ensurePKI loads or creates the CA, the server certificate and the
// administrator's client certificate.
func (e *Embedded) ensurePKI(dir string, hosts []string, log *slog.Logger) (TLS, error) {
	p, created, err := EnsurePKI(dir)
	if err != nil {
		return TLS{}, err
	}
	e.PKI, e.CreatedPKI = p, created
	if created {
		log.Info("created the cluster CA", "dir", dir)
	}
	server, issued, missing, err := p.EnsureServer(hosts)
	if err != nil {
		return TLS{}, err
	}
	if issued {
		log.Info("issued etcd's server certificate", "file", server.CertFile, "hosts", hosts)
	}
	if len(missing) > 0 {
		log.Warn("etcd's server certificate does not cover every address it serves; clients reaching it there will refuse it (remove it to have it issued anew)",
			"file", server.CertFile, "missing", missing)
	}
	if _, issued, err := p.EnsureClient(AdminName); err != nil {
		return TLS{}, err
	} else if issued {
		log.Info("issued the administrator's client certificate", "file", p.ClientTLS(AdminName).CertFile)
	}
	return server, nil
}

// serverHosts are the names etcd's certificate is for: the hosts of its
// URLs, loopback, and this machine's name when it listens on every address.
func serverHosts(urls ...*url.URL) []string {
	hosts := []string{"127.0.0.1", "localhost"}
	for _, u := range urls {
		h := u.Hostname()
		if ip := net.ParseIP(h); ip != nil && ip.IsUnspecified() {
			if name, err := os.Hostname(); err == nil {
				h = name
			}
		}
		if !slices.Contains(hosts, h) {
			hosts = append(hosts, h)
		}
	}
	return hosts
}

// ClientTLS returns a client certificate of name from the server's CA,
// issuing it when needed: what the agent beside it uses. An insecure server
// takes plain clients.
func (e *Embedded) ClientTLS(name string) (TLS, error) {
	if e.PKI == nil {
		return TLS{Insecure: true}, nil
	}
	t, _, err := e.PKI.EnsureClient(name)
	return t, err
}

// enableAuth turns on etcd's users and roles (see auth.go), as the
// administrator whose certificate ensurePKI made. An insecure server takes
// every client as it comes.
func (e *Embedded) enableAuth(ctx context.Context, cu *url.URL) error {
	if e.PKI == nil {
		return nil
	}
	u := *cu
	if ip := net.ParseIP(u.Hostname()); ip != nil && ip.IsUnspecified() {
		u.Host = net.JoinHostPort("127.0.0.1", u.Port())
	}
	e.adminURL = u.String()
	// The administrator reaches this very server: any name its certificate
	// has will do (an operator's may not cover loopback).
	if cert, err := readCert(filepath.Join(e.PKI.Dir, serverName+".crt")); err == nil {
		if len(cert.IPAddresses) > 0 {
			e.serverName = cert.IPAddresses[0].String()
		} else if len(cert.DNSNames) > 0 {
			e.serverName = cert.DNSNames[0]
		}
	}
	admin, err := e.Admin()
	if err != nil {
		return err
	}
	defer admin.Close()
	if err := admin.EnableAuth(ctx); err != nil {
		return fmt.Errorf("embedded etcd: %w", err)
	}
	return nil
}

// Admin opens the server as the administrator.
func (e *Embedded) Admin() (*Store, error) {
	if e.PKI == nil {
		return nil, fmt.Errorf("etcd at %s serves plain HTTP: it has no administrator", e.URL)
	}
	t := e.PKI.ClientTLS(AdminName)
	t.serverName = e.serverName
	return Open([]string{e.adminURL}, t)
}

// Err reports a fatal server error.
func (e *Embedded) Err() <-chan error { return e.etcd.Err() }

// Close stops the server.
func (e *Embedded) Close() { e.close.Do(e.etcd.Close) }
