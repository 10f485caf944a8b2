//go:build ignore

// skiff's source check: what a container sends carries its own addresses, in
// every mode. skv_from_container is the first filter on a container's
// host-side veth's clsact ingress (priority 1, tc.PrioSource): the cache's
// and the sockets layer's filters (from_container, sks_from_container) come
// after it and see only what it passed (TC_ACT_UNSPEC: on to the next
// filter). A filter, not a TCX program: attaching one of those waits for an
// RCU grace period, which CNI ADD would wait for too.
//
// It passes, for the veth's entry in skv_sources (keyed by ifindex):
//   IPv4 from the container's address and MAC;
//   ARP whose Ethernet and sender addresses are the container's, and the
//   RFC 5227 probe of its own address (sender 0.0.0.0).
// Everything else is dropped and counted: other sources (a neighbour's,
// another host's container, an outside address, 0.0.0.0), ARP that would
// teach a neighbour or the host a forged address, frames from another MAC
// (which would move that MAC's entry in the bridge's FDB to this port),
// VLAN-tagged frames, and every other protocol: the overlay is IPv4, and
// IPv6 link-local traffic between containers on the bridge would bypass
// the IPv4 policy. A veth with the program but no entry drops all.

#include <stdbool.h>
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "source.h"

char __license[] SEC("license") = "GPL";


struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32); // host-side veth ifindex
	__type(value, struct source);
	__uint(max_entries, 16384);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skv_sources SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, enum skv_reason); // names the counters (bpfmap.CounterNames)
	__type(value, __u64);
	__uint(max_entries, SKV_NR_REASONS);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skv_drops SEC(".maps");

// The ARP header with Ethernet/IPv4 addresses (RFC 826). linux/if_arp.h
// drags in libc headers.
#define ARPHRD_ETHER 1
#define ARPOP_REQUEST 1
struct arp4 {
	__be16 hrd;
	__be16 pro;
	__u8 hln;
	__u8 pln;
	__be16 op;
	__u8 sha[ETH_ALEN];
	__be32 spa;
	__u8 tha[ETH_ALEN];
	__be32 tpa;
} __attribute__((packed));

static __always_inline int drop(__u32 reason)
{
	__u64 *n = bpf_map_lookup_elem(&skv_drops, &reason);
	if (n)
		*n += 1;
	return TC_ACT_SHOT;
}

// The packet's first len bytes, linear; NULL if it is shorter. The stack's
// own packets have their headers linear and never pull.
static __always_inline void *head(struct __sk_buff *skb, __u32 len)
{
	void *data = (void *)(long)skb->data;
	if (data + len <= (void *)(long)skb->data_end)
		return data;
	if (len > skb->len || bpf_skb_pull_data(skb, len))
		return NULL;
	data = (void *)(long)skb->data;
	return data + len <= (void *)(long)skb->data_end ? data : NULL;
}

// Both MACs are 2-byte aligned (a map value's offset 4; a frame's offset 6
// or, in ARP, 22).
static __always_inline bool same_mac(const __u8 *a, const __u8 *b)
{
	const __u16 *x = (const __u16 *)a, *y = (const __u16 *)b;
	return ((x[0] ^ y[0]) | (x[1] ^ y[1]) | (x[2] ^ y[2])) == 0;
}

SEC("tc")
int skv_from_container(struct __sk_buff *skb)
{
	__u32 ifindex = skb->ifindex;
	struct source *src = bpf_map_lookup_elem(&skv_sources, &ifindex);
	if (!src)
		return drop(SKV_NO_ENTRY);
	if (skb->vlan_present)
		return drop(SKV_VLAN);
	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		struct ethhdr *eth = head(skb, ETH_HLEN + sizeof(struct iphdr));
		if (!eth)
			return drop(SKV_MALFORMED);
		struct iphdr *ip = (void *)(eth + 1);
		if (!same_mac(eth->h_source, src->mac))
			return drop(SKV_MAC_SOURCE);
		if (ip->saddr != src->ip)
			return drop(SKV_IP_SOURCE);
		return TC_ACT_UNSPEC;
	}
	if (skb->protocol == bpf_htons(ETH_P_ARP)) {
		struct ethhdr *eth = head(skb, ETH_HLEN + sizeof(struct arp4));
		if (!eth)
			return drop(SKV_MALFORMED);
		struct arp4 *arp = (void *)(eth + 1);
		if (!same_mac(eth->h_source, src->mac))
			return drop(SKV_MAC_SOURCE);
		if (arp->hrd != bpf_htons(ARPHRD_ETHER) || arp->pro != bpf_htons(ETH_P_IP) || arp->hln != ETH_ALEN ||
		    arp->pln != 4)
			return drop(SKV_MALFORMED);
		if (!same_mac(arp->sha, src->mac))
			return drop(SKV_ARP_SENDER);
		// An RFC 5227 probe of the container's own address (duplicate
		// address detection) says "0.0.0.0": receivers answer it and
		// learn nothing from it.
		bool probe = arp->op == bpf_htons(ARPOP_REQUEST) && arp->spa == 0 && arp->tpa == src->ip;
		if (arp->spa != src->ip && !probe)
			return drop(SKV_ARP_SENDER);
		return TC_ACT_UNSPEC;
	}
	return drop(SKV_OTHER_PROTOCOL);
}
