// Part of sockets.c (one bpf2go unit): overlay packets for replaced listeners (and their connections) to the host stack.
#pragma once

// for_container returns the IPv4 header of a packet for a container of
// this host, NULL for anything else.
static __always_inline struct iphdr *for_container(struct __sk_buff *skb)
{
	struct iphdr *ip = ipv4_of(skb);
	return ip && local_container(ip->daddr) ? ip : NULL;
}

// replaced_listener returns the replaced listener at a segment's
// destination (a reference to release), or NULL.
static __always_inline struct bpf_sock *replaced_listener(struct iphdr *ip, struct tcphdr *th)
{
	struct sks_key k = {.ip = ip->daddr, .port = th->dest};
	return bpf_map_lookup_elem(&sks_listen, &k);
}

// syncookie_ack says whether a segment that found no connection completes
// a handshake that a replaced listener answered with a syncookie (under a
// SYN flood it keeps no request for it). Only the listener can tell, by the
// cookie: the same port may be a container's own client's.
static __always_inline bool syncookie_ack(struct iphdr *ip, struct tcphdr *th)
{
	if (!th->ack || th->syn || th->rst)
		return false;
	struct bpf_sock *l = replaced_listener(ip, th);
	if (!l)
		return false;
	long err = bpf_tcp_check_syncookie(l, ip, sizeof(*ip), th, sizeof(*th));
	bpf_sk_release(l);
	if (err)
		return false;
	count(SKS_SYNCOOKIE_STEERED);
	return true;
}

// connection_for says whether the host stack has a connection (or a
// request, or a TIME_WAIT) for a segment to a container. Only containers
// that had a replaced listener can have one. The kernel's lookup ends in
// the listener path when it finds no connection, which runs sks_lookup:
// sks_probing has that answer "none" at once, so a listener is never
// returned, the host's own ones on every address included.
static __always_inline bool connection_for(struct __sk_buff *skb, struct iphdr *ip, struct tcphdr *th)
{
	if (!bpf_map_lookup_elem(&sks_served, &ip->daddr))
		return false;
	__u32 zero = 0;
	__u32 *probing = bpf_map_lookup_elem(&sks_probing, &zero);
	if (!probing)
		return false;
	struct bpf_sock_tuple t = {.ipv4 = {.saddr = ip->saddr, .daddr = ip->daddr, .sport = th->source, .dport = th->dest}};
	*probing = 1;
	struct bpf_sock *sk = bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	*probing = 0;
	// A listener comes back only where sks_lookup is not attached (tests).
	bool found = sk && sk->state != BPF_TCP_LISTEN;
	if (sk)
		bpf_sk_release(sk);
	return found || syncookie_ack(ip, th);
}

// for_host_stack says whether a packet for a container belongs to a
// replaced listener or to a connection accepted from one. Only a SYN goes
// by the listener's overlay address and port: other segments to that port
// may be a container's own connection that happens to use it (replies to a
// fallback client). Those go by their 4-tuple (connection_for).
static __always_inline bool for_host_stack(struct __sk_buff *skb, struct iphdr *ip)
{
	void *data_end = (void *)(long)skb->data_end;
	if (ip->protocol != IPPROTO_TCP)
		return false;
	struct tcphdr *th = (void *)ip + ip->ihl * 4;
	if ((void *)(th + 1) > data_end)
		return false;
	if (!th->syn || th->ack)
		return connection_for(skb, ip, th);
	struct bpf_sock *sk = replaced_listener(ip, th);
	if (!sk)
		return false;
	bpf_sk_release(sk);
	return true;
}

// route_container_packet decides where a packet for a container goes.
// Overlay packets for a replaced listener, or for a connection accepted
// from one, go to the host stack instead of the container: their TOS gets
// cfg_tos, which a local route of the host (table local) matches, so they
// are delivered locally, where sk_lookup (above) finds the listener and the
// established lookup the connection. So a container on the overlay — a
// fallback socket, no shim, another mode — reaches a replaced listener as
// it would a plain one. A route rather than a rule for a mark: with any
// routing rule of its own, the host looks up every route through the rule
// list (docs/sockets.md). With judge, the mark lets the overlay's policy
// judge the packet on INPUT, as it judges the overlay's on FORWARD.
//
// Any other packet with those TOS bits loses one (a DSCP of the form xxx111
// reaches the container one lower). Returns whether the packet is for the
// host stack.
static __always_inline bool route_container_packet(struct __sk_buff *skb, struct iphdr *ip, bool judge)
{
	if (!for_host_stack(skb, ip)) {
		keep_off_route(ip);
		return false;
	}
	set_tos(ip, ip->tos | cfg_tos);
	if (judge)
		skb->mark = cfg_mark;
	count(SKS_OVERLAY_STEERED);
	return true;
}

SEC("tc")
int sks_from_overlay(struct __sk_buff *skb)
{
	struct iphdr *ip = for_container(skb);
	if (ip && route_container_packet(skb, ip, true))
		return TC_ACT_OK; // the host stack's, by its route
	return TC_ACT_UNSPEC;
}

// into_lo turns a packet for the host stack into lo's ingress, where its
// TOS routes it locally. lo accepts sources that are local addresses
// (accept_local), which routing the packet on the bridge would refuse: the
// reverse route of a container of this host is then the local route too.
static __always_inline int into_lo(struct iphdr *ip)
{
	struct ethhdr *eth = (void *)ip - sizeof(*eth); // for_container checked it
	// lo's address is all zeros: any other destination is another host's.
	for (int i = 0; i < ETH_ALEN; i++)
		eth->h_dest[i] = 0;
	return bpf_redirect(LOOPBACK_IFINDEX, BPF_F_INGRESS);
}

// pull makes the first len bytes of a packet direct-readable, for a
// packet whose IP header was found past data_end. A packet socket
// (CAP_NET_RAW) can hand the veth a frame whose headers lie in paged data,
// where a check that reads only the linear part would pass them unread.
// The stack's own packets have their headers linear: they never pull.
static __always_inline bool pull(struct __sk_buff *skb, __u32 len)
{
	return len <= skb->len && bpf_skb_pull_data(skb, len) == 0;
}

// container_tcp_refused says whether a container's TCP segment must be
// dropped because it could carry skiff's option past this check, or is
// the option SYN itself (forged: only sockops writes it, on host sockets).
// Masqueraded to the host's address on its way to another host, it would
// pass that host's check of the claimed source. Refused:
//   - every TCP fragment: none shows the option, but the host reassembles
//     them and re-fragments the SYN with the option whole in a first
//     fragment (an 8-byte first fragment shows only the ports). A
//     container's TCP stack never sends one (it sizes segments to the
//     route's MTU, with DF); large UDP datagrams and other fragments pass;
//   - a segment whose header is cut short, or a SYN whose data offset is
//     below 5 or past the packet: the stack would drop them too, and the
//     option's place cannot be judged.
static __always_inline bool container_tcp_refused(struct __sk_buff *skb, struct iphdr *ip)
{
	if (fragment(ip)) {
		count(SKS_TCP_FRAGMENT);
		return true;
	}
	__u32 ihl = ip->ihl * 4, len = bpf_ntohs(ip->tot_len);
	// A header in paged data (see pull) is copied out rather than
	// pulled: a pull would move the packet under the caller's pointers.
	struct tcphdr copy, *th = tcp_of(skb, ip);
	if (!th) {
		if (bpf_skb_load_bytes(skb, sizeof(struct ethhdr) + ihl, &copy, sizeof(copy)))
			goto malformed;
		th = &copy;
	}
	// A BIG TCP segment (GSO) leaves tot_len 0: never a SYN.
	if (len && len < ihl + sizeof(*th))
		goto malformed;
	if (!th->syn || th->ack)
		return false;
	if (th->doff < 5 || ihl + th->doff * 4 > len)
		goto malformed;
	struct sks_opt o;
	if (syn_option(skb, ip, th, &o)) {
		count(SKS_SYN_FORGED);
		return true;
	}
	return false;
malformed:
	count(SKS_TCP_MALFORMED);
	return true;
}

// A local container's packets: refused if they could carry the option
// (above); for a replaced listener on this host, to the host stack.
SEC("tc")
int sks_from_container(struct __sk_buff *skb)
{
	struct iphdr *ip = ipv4_of(skb);
	if (!ip && skb->protocol == bpf_htons(ETH_P_IP) && pull(skb, sizeof(struct ethhdr) + sizeof(struct iphdr)))
		ip = ipv4_of(skb);
	if (!ip)
		return TC_ACT_UNSPEC;
	if (ip->protocol == IPPROTO_TCP && container_tcp_refused(skb, ip))
		return TC_ACT_SHOT;
	if (!local_container(ip->daddr) || !route_container_packet(skb, ip, true))
		return TC_ACT_UNSPEC;
	return into_lo(ip);
}

// Packets for a container that reach its veth were not steered on their
// way in, where the container has no listener when its listener was
// replaced: the host's own connections (a kubelet probe, a host-network
// process, one to a virtual address its OUTPUT DNATs), sent out on the
// bridge, and those whose destination a DNAT on this host made (a
// Service's virtual address or a node port, from outside, or from a
// container of this host: br_netfilter then bridges the DNATed frame from
// one port to the other, and no routed path sees it). On the container
// veth's egress they are turned back into the host stack. The policy does
// not judge them again: FORWARD judged the forwarded and bridged ones, and
// the host's packets to containers are not judged. They carry
// cfg_tracked_mark, for which the sockets layer's raw rule skips conntrack
// on their second pass (lo's PREROUTING): conntrack saw them on their
// first, and that entry's reply tuple — the listener's address, before a
// DNAT undoes it — would clash with a second entry for the packet's new
// tuple. The listener's replies leave through OUTPUT and meet the first
// entry, which undoes the DNAT.
SEC("tc")
int sks_to_container(struct __sk_buff *skb)
{
	struct iphdr *ip = for_container(skb);
	if (!ip || !route_container_packet(skb, ip, false))
		return TC_ACT_UNSPEC;
	skb->mark = cfg_tracked_mark;
	return into_lo(ip);
}
