package ipam

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/store"
)

// ErrTaken means a host's subnet is leased to another host.
var ErrTaken = errors.New("subnet leased to another host")

// Reclaim registers h under the subnet it already serves, h.Subnet, as
// after its host record or subnet lease was deleted or garbled in the
// store: it writes the record and the lease where they are missing,
// unreadable or different, and nothing when both are right (so calling it
// on every reconcile costs a read). It returns what it repaired ("" for
// nothing). A lease held by another host whose record names the subnet is
// ErrTaken: that host got the subnet while this one was gone, and only a
// new subnet (Join, on a restart) helps.
func Reclaim(ctx context.Context, s *store.Store, c cluster.Config, h cluster.Host) (string, error) {
	if !h.Subnet.IsValid() || h.Subnet != h.Subnet.Masked() || h.Subnet.Bits() != c.HostPrefix || !c.CIDR.Contains(h.Subnet.Addr()) {
		return "", fmt.Errorf("reclaim %s: subnet %s is not a /%d of %s", h.Name, h.Subnet, c.HostPrefix, c.CIDR)
	}
	hostKey, leaseKey := store.HostKey(h.Name), store.SubnetKey(h.Subnet)
	val, _ := json.Marshal(h)
	for range 8 {
		resp, err := s.Txn(ctx, nil, []clientv3.Op{clientv3.OpGet(hostKey), clientv3.OpGet(leaseKey)})
		if err != nil {
			return "", err
		}
		record, lease := only(resp, 0), only(resp, 1)
		var ops []clientv3.Op
		var repaired []string
		if lease == nil || string(lease.Value) != h.Name {
			if lease != nil {
				owner, err := claimant(ctx, s, string(lease.Value), h)
				if err != nil {
					return "", err
				}
				if owner != "" {
					return "", fmt.Errorf("subnet %s of %s: %w %s", h.Subnet, h.Name, ErrTaken, owner)
				}
			}
			ops = append(ops, clientv3.OpPut(leaseKey, h.Name))
			repaired = append(repaired, "subnet lease "+damage(lease))
		}
		var have cluster.Host
		if record == nil || json.Unmarshal(record.Value, &have) != nil || !have.Equal(h) {
			ops = append(ops, clientv3.OpPut(hostKey, string(val)))
			repaired = append(repaired, "host record "+damage(record))
		}
		if len(ops) == 0 {
			return "", nil
		}
		// Both keys as read: a concurrent Join cannot take a lease that
		// exists, and one that is absent must still be.
		resp, err = s.Txn(ctx, []clientv3.Cmp{unchanged(hostKey, record), unchanged(leaseKey, lease)}, ops)
		if err != nil {
			return "", err
		}
		if resp.Succeeded {
			return fmt.Sprint(repaired), nil
		}
	}
	return "", fmt.Errorf("reclaim %s: its keys keep changing", h.Name)
}

// claimant returns owner when owner, named by h's subnet lease, is a host
// whose record holds that subnet; "" when the lease is garbage (no such
// host, or one with another subnet).
func claimant(ctx context.Context, s *store.Store, owner string, h cluster.Host) (string, error) {
	other, err := s.Host(ctx, owner)
	switch {
	case errors.Is(err, store.ErrUnavailable):
		return "", err
	case err == nil && other.Name == owner && other.Subnet == h.Subnet:
		return owner, nil
	}
	return "", nil
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
