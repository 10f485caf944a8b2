// Part of cache.c (one bpf2go unit): flows between two containers of this
// host through the connection table, past the bridge, br_netfilter and
// conntrack.
//
// A flow's first packet (a SYN, a datagram, an echo request) is judged on
// the sender's veth by both verdicts the overlay's chain would apply on
// this host (the sender's egress, the receiver's ingress), opens one entry
// keyed by the side that opened it, and goes straight into the receiver's
// namespace; every later packet, either way, goes by that entry. The
// receiver must have a socket for it in its own namespace, as for a remote
// one (flows.h, has_listener). What the table does not take — a denied or
// unjudged flow, broadcast and multicast — crosses the bridge as before,
// where the overlay's FORWARD chain judges it (bridge-nf-call-iptables,
// which skiffd sets).
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

// local_open judges the first packet of a flow from the local container of
// k to the local container to and opens the flow; false leaves it to the
// bridge.
static __always_inline bool local_open(struct __sk_buff *skb, struct flow_key *k, struct ingress_ep *to)
{
	if (!first_packet()) {
		count(LO_NEW_UNJUDGED);
		return false;
	}
	__u16 port = dport(k, k->rport);
	int v = skp_verdict(&skp_egress, k->laddr, k->raddr, k->proto, port);
	if (v == SKP_ALLOW)
		v = skp_verdict(&skp_ingress, k->raddr, k->laddr, k->proto, port);
	if (v != SKP_ALLOW) {
		count(v == SKP_DENY ? LO_NEW_DENIED : LO_NEW_UNJUDGED);
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
		count(LO_NEW_NO_LISTENER);
		return false;
	}
	if (tracked(skb, k, true)) {
		count(LO_NEW_TRACKED);
		return false;
	}
	if (!open_flow(k, true, LO_TABLE_FULL))
		return false;
	count(LO_TABLE_OPEN);
	return true;
}

// local_flow carries a packet between two containers of this host by the
// connection table, or leaves it to the bridge.
static __always_inline int local_flow(struct __sk_buff *skb, struct flow_key *k, enum parse p, __u8 fl)
{
	struct ingress_ep *to = bpf_map_lookup_elem(&skc_ingress, &k->raddr);
	if (!to || !to->ready) {
		count(LO_PASS); // the gateway, a broadcast, or no container of this host
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
	if (s) {
		if (!rides(s, k->proto, fl, fin_bit == 1)) {
			count(LO_PASS);
			return TC_ACT_UNSPEC;
		}
		track(key, s, fl, fin_bit);
	} else if (!opens(k->proto, p == PARSE_START, fl)) {
		count(LO_PASS);
		return TC_ACT_UNSPEC;
	} else if (!local_open(skb, k, to)) {
		return TC_ACT_UNSPEC;
	}
	count(LO_TABLE_HIT);
	return deliver_local(skb, to);
}
