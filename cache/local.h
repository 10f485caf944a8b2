// Part of cache.c (one bpf2go unit): TCP between two containers of this
// host through the connection table, past the bridge, br_netfilter and
// conntrack.
//
// The SYN is judged on the sender's veth by both verdicts the overlay's
// chain would apply on this host (the sender's egress, the receiver's
// ingress), opens one entry keyed by the side that opened it, and goes
// straight into the receiver's namespace; every later segment, either
// way, goes by that entry. The receiver must have a socket for the SYN in
// its own namespace, as for a remote one (flows.h, has_listener). What the
// table does not take crosses the bridge as before, where the overlay's
// FORWARD chain judges it (bridge-nf-call-iptables, which skiffd sets).
#pragma once

// deliver_local hands a container's frame to another container of this
// host: its destination MAC the receiver's (a bridged frame, no hop: the
// TTL stays).
static __always_inline int deliver_local(struct __sk_buff *skb, struct ingress_ep *to)
{
	__u32 ifindex = to->ifindex;
	bool shaped = to->shaped;
	if (bpf_skb_store_bytes(skb, 0, to->mac_dst, ETH_ALEN, 0)) {
		count(LO_ERR);
		return TC_ACT_UNSPEC;
	}
	// A receiver with an ingress rate limit gets it through its host
	// veth's qdisc, as on the cross-host path.
	if (shaped)
		return bpf_redirect(ifindex, 0);
	return bpf_redirect_peer(ifindex, 0);
}

// local_syn judges a SYN from the local container of k to the local
// container to and opens its connection; false leaves it to the bridge.
static __always_inline bool local_syn(struct __sk_buff *skb, struct flow_key *k, struct ingress_ep *to)
{
	if (!first_packet()) {
		count(LO_SYN_UNJUDGED);
		return false;
	}
	__u16 port = bpf_ntohs(k->rport);
	int v = skp_verdict(&skp_egress, k->laddr, k->raddr, IPPROTO_TCP, port);
	if (v == SKP_ALLOW)
		v = skp_verdict(&skp_ingress, k->raddr, k->laddr, IPPROTO_TCP, port);
	if (v != SKP_ALLOW) {
		count(v == SKP_DENY ? LO_SYN_DENIED : LO_SYN_UNJUDGED);
		return false;
	}
	// The reply goes by the sender's entry.
	struct ingress_ep *self = bpf_map_lookup_elem(&skc_ingress, &k->laddr);
	if (!self || !self->ready) {
		count(LO_NO_PATH);
		return false;
	}
	struct flow_key at = *k; // the receiver's view: it is the local side
	swap_key(&at);
	if (!has_listener(skb, &at, to->netns_id)) {
		count(LO_SYN_NO_LISTENER);
		return false;
	}
	if (!open_flow(k, true, LO_TABLE_FULL))
		return false;
	count(LO_TABLE_OPEN);
	return true;
}

// local_tcp carries a TCP segment between two containers of this host by
// the connection table, or leaves it to the bridge.
static __always_inline int local_tcp(struct __sk_buff *skb, struct flow_key *k, enum parse p, __u8 fl)
{
	struct ingress_ep *to = bpf_map_lookup_elem(&skc_ingress, &k->raddr);
	if (!to || !to->ready) {
		count(LO_PASS); // the gateway, or no container of this host
		return TC_ACT_UNSPEC;
	}
	struct flow_key rev = *k;
	swap_key(&rev);
	if (p == PARSE_START) {
		// A connection that reuses a 4-tuple starts unknown.
		if (bpf_map_lookup_elem(&skc_flows, k))
			bpf_map_delete_elem(&skc_flows, k);
		if (bpf_map_lookup_elem(&skc_flows, &rev))
			bpf_map_delete_elem(&skc_flows, &rev);
		if (!local_syn(skb, k, to))
			return TC_ACT_UNSPEC;
		count(LO_TABLE_HIT);
		return deliver_local(skb, to);
	}
	// Keyed by the side that opened it: this one (FIN bit 1) or the other.
	struct flow_key *key = k;
	__u8 fin_bit = 1;
	struct flow_state *s = bpf_map_lookup_elem(&skc_flows, k);
	if (!s) {
		key = &rev;
		fin_bit = 2;
		s = bpf_map_lookup_elem(&skc_flows, &rev);
	}
	if (!s) {
		count(LO_PASS);
		return TC_ACT_UNSPEC;
	}
	track(key, s, fl, fin_bit);
	count(LO_TABLE_HIT);
	return deliver_local(skb, to);
}
