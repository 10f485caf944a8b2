// Part of sockets.c (one bpf2go unit): the recorder on the underlay: option SYNs of other hosts' containers.
#pragma once

SEC("tc")
int sks_from_underlay(struct __sk_buff *skb)
{
	struct iphdr *ip = ipv4_of(skb);
	if (!ip)
		return TC_ACT_UNSPEC;
	// Straight from the underlay to a container (no overlay): as from a
	// container or the overlay, only steered packets may match the route.
	if (local_container(ip->daddr))
		keep_off_route(ip);
	// Only a whole SYN is recorded: a fragment's bytes after the first
	// are no TCP header, and a first fragment's option is not the SYN's
	// until reassembly.
	if (ip->protocol == IPPROTO_TCP && fragment(ip))
		return underlay_fragment(skb, ip);
	struct tcphdr *th = syn_of(skb, ip);
	if (!th)
		return TC_ACT_UNSPEC;
	struct sks_tuple t = {.saddr = ip->saddr, .daddr = ip->daddr, .sport = th->source, .dport = th->dest};
	struct sks_opt o;
	if (!syn_option(skb, ip, th, &o)) {
		// A plain SYN is the host's: a record of its 4-tuple (a fast-path
		// handshake that failed) must not steer it to a container. Looked
		// up first: a delete takes the bucket's lock even for nothing,
		// and every SYN of the host's own connections comes here.
		if (bpf_map_lookup_elem(&sks_syns, &t))
			bpf_map_delete_elem(&sks_syns, &t);
		return TC_ACT_UNSPEC;
	}
	__be32 src = o.src_ip, dst = o.dst_ip;
	__be16 port = o.dst_port;
	// The option is not authenticated: it may only claim a container of the
	// host the SYN comes from, and only a container of this host.
	struct sks_subnet k = {.prefixlen = 32, .ip = src};
	__be32 *owner = bpf_map_lookup_elem(&sks_subnets, &k);
	if (!owner || *owner != ip->saddr) {
		count(SKS_SYN_SPOOFED);
		return TC_ACT_SHOT;
	}
	if ((dst & cfg_local_mask) != cfg_local_net || !port) {
		count(SKS_SYN_MALFORMED);
		return TC_ACT_SHOT;
	}
	struct sks_pending p = {.dst_ip = dst, .src_ip = src, .dst_port = port};
	bpf_map_update_elem(&sks_syns, &t, &p, BPF_ANY);
	count(SKS_SYN_RECORDED);
	return TC_ACT_UNSPEC;
}
