package cli

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"time"

	"github.com/skiffnet/skiff/store"
)

const certUsage = "usage: skiff cert issue|allow --ca-dir DIR --name HOST [--out DIR] [--etcd-endpoints URL]"

// cmdCert issues etcd client certificates from the cluster CA, and makes
// the store's user and role of a host: what another host needs to join the
// cluster store.
func cmdCert(ctx context.Context, env Env, args []string) error {
	if len(args) == 1 && isHelp(args[0]) {
		fmt.Fprintln(env.Stdout, certUsage)
		return nil
	}
	if len(args) == 0 || args[0] != "issue" && args[0] != "allow" {
		return usagef(certUsage)
	}
	issue := args[0] == "issue"
	fs := flags(env, "cert "+args[0])
	caDir := fs.String("ca-dir", "", "directory of the cluster CA (the embedded etcd's DIR/pki, or the lab's)")
	name := fs.String("name", "", "the host's name (its skiffd --name), or "+store.AdminName+" for the administrator")
	out := fs.String("out", "", "directory to write ca.crt, NAME.crt and NAME.key to (made mode 0700)")
	endpoint := fs.String("etcd-endpoints", "", "client URL of the store: there the administrator (CA-DIR/"+store.AdminName+".crt) makes the host's user and role")
	if err := parse(fs, args[1:]); err != nil {
		return err
	}
	if *caDir == "" || *name == "" || issue && *out == "" || !issue && *endpoint == "" || fs.NArg() > 0 {
		return usagef(certUsage)
	}
	p, err := store.LoadPKI(*caDir)
	if err != nil {
		return err
	}
	if !issue {
		return allowHost(ctx, p, *name, *endpoint)
	}
	if *name != store.AdminName {
		if err := store.ValidateHostName(*name); err != nil {
			return err
		}
	}
	now := time.Now()
	t, err := p.Issue(*name, false, nil, *out, now.Add(-time.Hour), now.Add(store.LeafValidity))
	if err != nil {
		return err
	}
	fmt.Fprintf(env.Stdout, "issued %s (key %s, CA %s)\n", t.CertFile, t.KeyFile, t.CAFile)
	if *name == store.AdminName {
		return nil
	}
	url := *endpoint
	var allowErr error
	if url == "" {
		url = "https://STORE:2379"
		fmt.Fprintf(env.Stdout, "the store lets %s in once it has its user and role: skiff cert allow --ca-dir %s --name %s --etcd-endpoints %s\n", *name, *caDir, *name, url)
	} else if allowErr = allowHost(ctx, p, *name, url); allowErr == nil {
		fmt.Fprintf(env.Stdout, "made %s's user and role in the store at %s\n", *name, url)
	}
	// The other host reaches the store at an address of the network, not
	// at this machine's loopback.
	remote := url
	if loopbackURL(url) {
		remote = "https://STORE-ADDRESS:2379"
		fmt.Fprintf(env.Stderr, "skiff: %s is this machine's loopback: %s reaches the store at an address of the network (the embedded etcd's --embedded-etcd-listen)\n", url, *name)
	}
	fmt.Fprintf(env.Stdout, "copy %s to %s as /etc/skiff/pki and run there:\n  skiffd --name %s --etcd-endpoints %s --etcd-cafile /etc/skiff/pki/%s --etcd-certfile /etc/skiff/pki/%s.crt --etcd-keyfile /etc/skiff/pki/%s.key\n",
		*out, *name, *name, remote, store.CAFile, *name, *name)
	if allowErr != nil {
		// The certificate is issued, but the host cannot join yet: a
		// script must not take this for success.
		return fmt.Errorf("%w\n%s's certificate is issued; once the store answers: skiff cert allow --ca-dir %s --name %s --etcd-endpoints %s", allowErr, *name, *caDir, *name, url)
	}
	return nil
}

// loopbackURL reports whether every host of a comma-separated URL list is
// a loopback address or localhost.
func loopbackURL(urls string) bool {
	for _, u := range strings.Split(urls, ",") {
		h := u
		if i := strings.Index(h, "://"); i >= 0 {
			h = h[i+3:]
		}
		if host, _, err := net.SplitHostPort(h); err == nil {
			h = host
		}
		if ip, err := netip.ParseAddr(h); !(h == "localhost" || err == nil && ip.IsLoopback()) {
			return false
		}
	}
	return true
}

// allowHost makes host's user and role in the store at endpoints, as the
// administrator, whose certificate the CA issues when it has none.
func allowHost(ctx context.Context, p *store.PKI, host, endpoints string) error {
	admin, _, err := p.EnsureClient(store.AdminName)
	if err != nil {
		return err
	}
	s, err := store.Open(strings.Split(endpoints, ","), admin)
	if err != nil {
		return err
	}
	defer s.Close()
	if err := s.AllowHost(ctx, host); err != nil {
		return fmt.Errorf("user and role of %s: %w", host, err)
	}
	return nil
}
