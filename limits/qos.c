//go:build ignore

// QoS classes on the underlay: skq_underlay, tc egress of the underlay
// device (after the cache's to_underlay, which learns and never takes a
// packet), marks the VXLAN packets of a container of the high or low
// class: the outer header's DSCP (ECN bits kept, checksum fixed) for the
// network beyond the host, skb->priority for this host's qdisc; every
// other VXLAN packet of the overlay gets the normal class's priority, so
// a priority the container chose (SO_PRIORITY, or IP_TOS, which sets it)
// never picks the underlay's band or class, nor its HTB's direct queue: a
// packet's priority survives the veth and the cache's redirect. It sees
// the overlay's packets and the cache's alike (both leave through the
// underlay's egress). Host sockets get their class from sockops
// (limits.c: IP_TOS and SO_PRIORITY on the socket), the same TOS and
// priority.

#include <stdbool.h>
#include <stddef.h>
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "qos.h"

char __license[] SEC("license") = "GPL";

volatile const __be16 cfg_vxlan_port; // network order

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __be32); // a local container's overlay address
	__type(value, enum skq_class);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skq_classes SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, SKQ_NCOUNTERS);
	__type(key, enum skq_counter);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skq_stats SEC(".maps");

#define TC_ACT_UNSPEC (-1)
#define VXLAN_HLEN 8
#define DSCP_CS4 0x80
#define DSCP_CS1 0x20
#define HTB_MAJOR 0x5c

static __always_inline void count(enum skq_counter c)
{
	__u32 k = c;
	__u64 *v = bpf_map_lookup_elem(&skq_stats, &k);
	if (v)
		*v += 1;
}

SEC("tc")
int skq_underlay(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_UNSPEC;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end || ip->ihl != 5 || ip->protocol != IPPROTO_UDP)
		return TC_ACT_UNSPEC;
	struct udphdr *uh = (void *)(ip + 1);
	if ((void *)(uh + 1) > end || uh->dest != cfg_vxlan_port)
		return TC_ACT_UNSPEC;
	struct ethhdr *ieth = (void *)(uh + 1) + VXLAN_HLEN;
	struct iphdr *inner = (void *)(ieth + 1);
	if ((void *)(inner + 1) > end || ieth->h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_UNSPEC;
	__be32 src = inner->saddr;
	enum skq_class *class = bpf_map_lookup_elem(&skq_classes, &src);
	if (!class || *class == SKQ_NORMAL) {
		skb->priority = (HTB_MAJOR << 16) | 8; // normal
		count(SKQ_UNCLASSED);
		return TC_ACT_UNSPEC;
	}
	__u8 dscp = DSCP_CS1, minor = 2; // low
	if (*class == SKQ_HIGH)
		dscp = DSCP_CS4, minor = 6;
	__u8 old = ip->tos, tos = (old & 0x03) | dscp;
	if (tos != old) {
		// The TOS byte is the low byte of the first 16-bit word.
		__be16 from = bpf_htons(((__u16)ip->version << 12) | ((__u16)ip->ihl << 8) | old);
		__be16 to = bpf_htons(((__u16)ip->version << 12) | ((__u16)ip->ihl << 8) | tos);
		if (bpf_l3_csum_replace(skb, ETH_HLEN + offsetof(struct iphdr, check), from, to, 2) ||
		    bpf_skb_store_bytes(skb, ETH_HLEN + offsetof(struct iphdr, tos), &tos, 1, 0))
			return TC_ACT_UNSPEC;
	}
	skb->priority = (HTB_MAJOR << 16) | minor;
	count(SKQ_MARKED);
	return TC_ACT_UNSPEC;
}
