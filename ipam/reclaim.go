package ipam

import (
	"context"
	"fmt"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/source"
	"github.com/skiffnet/skiff/store"
)

// ErrTaken means another host holds a host's subnet.
var ErrTaken = source.ErrTaken

// Reclaim registers h under the subnet it already serves, h.Subnet, as
// after its host record or subnet claim was deleted or garbled in the
// store: it writes the record and the claim where they are missing,
// unreadable or different, and nothing when both are right (so calling it
// on every reconcile costs a read). It returns what it repaired ("" for
// nothing). A claim re-created is younger than any other on the subnet,
// so it holds only if there is none: a subnet another host holds is
// ErrTaken, and only a new subnet (Join, on a restart) helps.
func Reclaim(ctx context.Context, s *store.Store, c cluster.Config, h cluster.Host) (string, error) {
	if !valid(c, h.Subnet) {
		return "", fmt.Errorf("reclaim %s: subnet %s is not a /%d of %s", h.Name, h.Subnet, c.HostPrefix, c.CIDR)
	}
	_, repaired, err := settle(ctx, s, c, h, true)
	return strings.Join(repaired, ", "), err
}

func only(resp *clientv3.TxnResponse, i int) *mvccpb.KeyValue {
	if kvs := resp.Responses[i].GetResponseRange().Kvs; len(kvs) == 1 {
		return kvs[0]
	}
	return nil
}

func unchanged(key string, kv *mvccpb.KeyValue) clientv3.Cmp {
	var rev int64
	if kv != nil {
		rev = kv.ModRevision
	}
	return clientv3.Compare(clientv3.ModRevision(key), "=", rev)
}

func damage(kv *mvccpb.KeyValue) string {
	if kv == nil {
		return "(missing)"
	}
	return "(wrong)"
}
