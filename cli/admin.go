package cli

import (
	"flag"
	"fmt"
	"strings"

	"github.com/skiffnet/skiff/lab"
	"github.com/skiffnet/skiff/store"
)

// adminStore adds the flags of the administrator's store credential and
// returns a function that opens the store with them: policy changes and
// host removal are the administrator's, which no agent can make. With no
// --etcd-endpoints and a lab up, it opens the lab's store as its
// administrator.
func adminStore(env Env, fs *flag.FlagSet) func() (*store.Store, error) {
	endpoints := fs.String("etcd-endpoints", "", "comma-separated client URLs of the cluster store, reached as the administrator")
	var t store.TLS
	fs.StringVar(&t.CAFile, "etcd-cafile", "", "CA certificate of the cluster store")
	fs.StringVar(&t.CertFile, "etcd-certfile", "", "the administrator's client certificate (common name "+store.AdminName+"; the embedded etcd's DIR/pki/"+store.AdminName+".crt)")
	fs.StringVar(&t.KeyFile, "etcd-keyfile", "", "key of the administrator's certificate")
	fs.BoolVar(&t.Insecure, "etcd-insecure", false, "reach the store over plain HTTP, without authentication")
	return func() (*store.Store, error) {
		if *endpoints == "" {
			for _, name := range lab.List() {
				if l, err := lab.Open(name); err == nil {
					fmt.Fprintf(env.Stderr, "(no --etcd-endpoints; using lab %s's store as %s)\n", name, store.AdminName)
					return l.OpenStore("", store.AdminName)
				}
			}
			return nil, usagef("changing the cluster takes the administrator's credential: give --etcd-endpoints, --etcd-cafile, --etcd-certfile and --etcd-keyfile (certificate %s.crt)", store.AdminName)
		}
		var eps []string
		for _, e := range strings.Split(*endpoints, ",") {
			if e = strings.TrimSpace(e); e != "" {
				eps = append(eps, e)
			}
		}
		return store.Open(eps, t)
	}
}
