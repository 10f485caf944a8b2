package store

import (
	"context"
	"fmt"
	"net/url"
	"sync"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

// Embedded is an etcd server running inside this process: the real server as
// a library, so one machine needs nothing else installed.
type Embedded struct {
	etcd  *embed.Etcd
	URL   string
	close sync.Once
}

// StartEmbedded runs a single-member etcd cluster with its data in dir,
// serving clients on clientURL (e.g. http://127.0.0.1:2379) and peers on
// peerURL. It returns once the server is ready to serve.
func StartEmbedded(ctx context.Context, dir, clientURL, peerURL string) (*Embedded, error) {
	cu, err := url.Parse(clientURL)
	if err != nil {
		return nil, fmt.Errorf("etcd client URL %q: %w", clientURL, err)
	}
	pu, err := url.Parse(peerURL)
	if err != nil {
		return nil, fmt.Errorf("etcd peer URL %q: %w", peerURL, err)
	}
	cfg := embed.NewConfig()
	cfg.Name = "skiff"
	cfg.Dir = dir
	cfg.LogLevel = "error"
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*cu}, []url.URL{*cu}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*pu}, []url.URL{*pu}
	cfg.InitialCluster = cfg.Name + "=" + pu.String()
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, fmt.Errorf("start embedded etcd in %s: %w", dir, err)
	}
	select {
	case <-e.Server.ReadyNotify():
		return &Embedded{etcd: e, URL: cu.String()}, nil
	case err := <-e.Err():
		e.Close()
		return nil, fmt.Errorf("embedded etcd: %w", err)
	case <-time.After(30 * time.Second):
		e.Close()
		return nil, fmt.Errorf("embedded etcd in %s not ready after 30s", dir)
	case <-ctx.Done():
		e.Close()
		return nil, ctx.Err()
	}
}

// Err reports a fatal server error.
func (e *Embedded) Err() <-chan error { return e.etcd.Err() }

// Close stops the server.
func (e *Embedded) Close() { e.close.Do(e.etcd.Close) }
