package overlay

import (
	"errors"
	"fmt"

	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/limits"
)

// SyncLimits applies every local endpoint's rate limit as it stands now:
// skiff limit changes one while its container runs (in place: HTB changes
// the class, queued packets and connections stay), and a qdisc removed
// from under skiff (by a container with NET_ADMIN in its namespace) is put
// back. An endpoint found unlimited before and still unlimited costs
// nothing. A failure is the container's, never the host's: it is logged
// and tried again at the next sync.
func (o *Overlay) SyncLimits(eps []cluster.Endpoint) {
	shaped, failed := make(map[string]limits.Limit, len(eps)), map[string]string{}
	for _, e := range eps {
		key := e.ContainerID + "/" + e.IfName
		if prev, seen := o.shaped[key]; seen && prev.None() && e.Limit.None() {
			shaped[key] = e.Limit
			continue
		}
		host, err := netlink.LinkByName(e.Veth)
		if err == nil {
			err = reshape(e, host)
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
}

// reshape applies e's limit, as it is now, to an endpoint built earlier
// (host is its host veth). An endpoint whose namespace skiffd cannot enter
// again (NetnsHidden) gets its ingress limit; its egress limit, in its
// namespace, is the one it had at ADD.
func reshape(e cluster.Endpoint, host netlink.Link) error {
	h, _, done, err := inNetns(e)
	if errors.Is(err, ErrNetnsHidden) {
		if err := limits.Shape(&netlink.Handle{}, host, e.Limit.IngressRate, e.Limit.IngressBurst); err != nil {
			return err
		}
		return fmt.Errorf("egress limit unchanged: %w", err)
	}
	if err != nil {
		return err
	}
	defer done()
	c, err := h.LinkByName(e.IfName)
	if err != nil {
		return fmt.Errorf("container %s: %w", e.IfName, err)
	}
	return shape(h, c, host, e.Limit)
}
