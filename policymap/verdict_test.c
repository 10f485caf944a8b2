//go:build ignore

// Test programs of policymap.h: the verdict for an IPv4 packet, as the
// sending container's host judges it (egress) and as the receiving
// container's does (ingress), returned as the program's result.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "policymap.h"

char __license[] SEC("license") = "GPL";

#define SKP_MALFORMED 99

static __always_inline int judge(struct __sk_buff *skb, int egress)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP) || ip->ihl != 5)
		return SKP_MALFORMED;
	__u16 port = 0;
	if (ip->protocol == IPPROTO_TCP || ip->protocol == IPPROTO_UDP) {
		struct udphdr *l4 = (void *)(ip + 1); // the ports sit alike in both
		if ((void *)(l4 + 1) > end)
			return SKP_MALFORMED;
		port = bpf_ntohs(l4->dest);
	}
	if (egress)
		return skp_verdict(&skp_egress, ip->saddr, ip->daddr, ip->protocol, port);
	return skp_verdict(&skp_ingress, ip->daddr, ip->saddr, ip->protocol, port);
}

SEC("tc")
int skp_test_egress(struct __sk_buff *skb) { return judge(skb, 1); }

SEC("tc")
int skp_test_ingress(struct __sk_buff *skb) { return judge(skb, 0); }
