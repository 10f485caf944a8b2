package overlay

import (
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/limits"
)

// repairEvery is how often SyncLimits checks the qdiscs of limits that
// have not changed: a container holding NET_ADMIN in its namespace can
// delete the one on its own interface.
const repairEvery = 30 * time.Second

// SyncLimits applies every local endpoint's rate limit and QoS class as
// they stand now:
// skiff limit changes one while its container runs (in place: HTB changes
// the class, queued packets and connections stay), and every repairEvery
// a qdisc removed from under skiff is put back. Between, an unchanged
// limit costs nothing. A failure is the container's, never the host's: it
// is logged and tried again at the next sync.
func (o *Overlay) SyncLimits(eps []cluster.Endpoint) {
	repair := time.Since(o.repaired) >= repairEvery
	if repair {
		o.repaired = time.Now()
	}
	shaped, failed := make(map[string]cluster.Limit, len(eps)), map[string]string{}
	classes := make(map[netip.Addr]string, len(eps))
	for _, e := range eps {
		classes[e.IP.Addr()] = e.Limit.Class
		key := e.ContainerID + "/" + e.IfName
		prev, seen := o.shaped[key]
		if seen && prev == e.Limit && (!repair || e.Limit.None()) {
			shaped[key] = e.Limit
			continue
		}
		if e.NetnsHidden && seen && (prev.EgressRate != e.Limit.EgressRate || prev.EgressBurst != e.Limit.EgressBurst) {
			o.log.Warn("egress limit unchanged: skiffd cannot enter the container's namespace again (its runtime's mount namespace hides it); in force at its next ADD",
				"container", e.ContainerID)
		}
		host, err := netlink.LinkByName(e.Veth)
		if err == nil {
			err = o.reshape(e, host)
		}
		if err != nil {
			if prev, ok := o.limitErrs[key]; !ok || prev != err.Error() {
				o.log.Warn("cannot apply a container's rate limit; tried again at every sync", "container", e.ContainerID, "err", err)
			}
			failed[key] = err.Error()
			continue
		}
		shaped[key] = e.Limit
	}
	o.shaped, o.limitErrs = shaped, failed
	if repair && o.police != nil {
		// Policers of veths no limited endpoint has (containers deleted
		// while the agent was down) go.
		keep := map[uint32]bool{}
		for _, e := range eps {
			if l, err := netlink.LinkByName(e.Veth); err == nil && e.Limit.EgressRate != 0 {
				keep[uint32(l.Attrs().Index)] = true
			}
		}
		if err := o.police.Prune(keep); err != nil {
			o.log.Warn("prune egress policers", "err", err)
		}
	}
	if o.qos == nil {
		return
	}
	if err := o.qos.Sync(classes); err != nil {
		o.log.Warn("QoS classes", "err", err)
	}
}

// reshape applies e's limit, as it is now, to an endpoint built earlier
// (host is its host veth). An endpoint whose namespace skiffd cannot enter
// again (NetnsHidden) gets its ingress limit and its egress policer; the
// egress HTB, in its namespace, stays the one it had at ADD.
func (o *Overlay) reshape(e cluster.Endpoint, host netlink.Link) error {
	h, _, done, err := inNetns(e)
	if errors.Is(err, ErrNetnsHidden) {
		return errors.Join(limits.Shape(&netlink.Handle{}, host, e.Limit.IngressRate, e.Limit.IngressBurst),
			o.police.Set(&netlink.Handle{}, host, e.Limit.EgressRate, e.Limit.EgressBurst))
	}
	if err != nil {
		return err
	}
	defer done()
	c, err := h.LinkByName(e.IfName)
	if err != nil {
		return fmt.Errorf("container %s: %w", e.IfName, err)
	}
	return o.shape(h, c, host, e.Limit)
}

// QoSCounters are the QoS marking program's counters.
func (o *Overlay) QoSCounters() (map[string]uint64, error) {
	if o.qos == nil {
		return nil, nil
	}
	return o.qos.Counters()
}
