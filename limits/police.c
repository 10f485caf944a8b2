//go:build ignore

// The host side of a container's egress limit. The limit is shaped on the
// container's own interface (an HTB in its namespace: queued, smooth), but
// a container can send past that qdisc: a packet socket with
// PACKET_QDISC_BYPASS skips it, and cgroup_skb (the host sockets'
// backstop) never sees packet sockets. skr_police, on the ingress of the
// container's host-side veth — which every packet the container sends
// crosses, and the container cannot change — polices what arrives to the
// limit, a little above it (Go: policeHeadroom), so that traffic the HTB
// shaped passes untouched and only what went around it is dropped. It
// runs before every other skiff program there (tc.PrioPolice), the
// cache's redirect to the underlay and the sockets layer's turn to the
// host stack included. Only limited containers' veths carry it.

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#include "police.h"
#include "bucket.h"

char __license[] SEC("license") = "GPL";

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32); // host veth ifindex
	__type(value, struct skr_policer);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skr_policers SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, SKR_NCOUNTERS);
	__type(key, enum skr_counter);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skr_stats SEC(".maps");

static __always_inline void count(enum skr_counter c)
{
	__u32 k = c;
	__u64 *v = bpf_map_lookup_elem(&skr_stats, &k);
	if (v)
		*v += 1;
}

SEC("tc")
int skr_police(struct __sk_buff *skb)
{
	__u32 k = skb->ifindex;
	struct skr_policer *p = bpf_map_lookup_elem(&skr_policers, &k);
	if (!p)
		return TC_ACT_UNSPEC;
	__u64 now = bpf_ktime_get_ns(); // no helper call under the lock
	bpf_spin_lock(&p->lock);
	bool pass = bucket_take(&p->tokens, &p->last, p->rate, p->burst, skb->len, now);
	bpf_spin_unlock(&p->lock);
	count(pass ? SKR_PASSED : SKR_DROPPED);
	return pass ? TC_ACT_UNSPEC : TC_ACT_SHOT;
}
