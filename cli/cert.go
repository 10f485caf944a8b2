package cli

import (
	"context"
	"fmt"
	"time"

	"github.com/skiffnet/skiff/store"
)

// cmdCert issues etcd client certificates from the cluster CA: what
// another host needs to join the cluster store.
func cmdCert(_ context.Context, env Env, args []string) error {
	if len(args) == 0 || args[0] != "issue" {
		return usagef("usage: skiff cert issue --ca-dir DIR --name HOST --out DIR")
	}
	fs := flags(env, "cert issue")
	caDir := fs.String("ca-dir", "", "directory of the cluster CA (the embedded etcd's DIR/pki, or the lab's)")
	name := fs.String("name", "", "the host's name (its skiffd --name), or "+store.AdminName+" for the administrator")
	out := fs.String("out", "", "directory to write ca.crt, NAME.crt and NAME.key to (made mode 0700)")
	endpoint := fs.String("etcd-endpoints", "https://STORE:2379", "client URL of the store, for the command printed")
	if err := parse(fs, args[1:]); err != nil {
		return err
	}
	if *caDir == "" || *name == "" || *out == "" || fs.NArg() > 0 {
		return usagef("usage: skiff cert issue --ca-dir DIR --name HOST --out DIR")
	}
	p, err := store.LoadPKI(*caDir)
	if err != nil {
		return err
	}
	now := time.Now()
	t, err := p.Issue(*name, false, nil, *out, now.Add(-time.Hour), now.Add(store.LeafValidity))
	if err != nil {
		return err
	}
	fmt.Fprintf(env.Stdout, "issued %s (key %s, CA %s)\n", t.CertFile, t.KeyFile, t.CAFile)
	if *name != store.AdminName {
		fmt.Fprintf(env.Stdout, "copy %s to %s as /etc/skiff/pki and run there:\n  skiffd --name %s --etcd-endpoints %s --etcd-cafile /etc/skiff/pki/%s --etcd-certfile /etc/skiff/pki/%s.crt --etcd-keyfile /etc/skiff/pki/%s.key\n",
			*out, *name, *name, *endpoint, store.CAFile, *name, *name)
	}
	return nil
}
