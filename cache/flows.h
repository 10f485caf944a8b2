// Part of cache.c (one bpf2go unit): the connection table, which carries a
// TCP connection between a local and a remote container on the fast path
// from its first SYN, past the overlay's conntrack and netfilter.
//
// A SYN is judged here by the policy compiled into policymap.h's maps, on
// the host it leaves (egress verdict) and on the host it reaches (ingress
// verdict), as the overlay's SKIFF-POLICY chain judges it on both. Only an
// allowed SYN whose every path is known opens a table entry — the reply's
// path included, so no packet of a table flow ever needs the overlay — and
// every later segment of the connection, both ways, goes by the entry:
// the overlay's conntrack never sees the flow at all. Everything else (a
// SYN denied or not yet judgeable, a full table, a missing entry) takes
// the overlay, which judges as before.
#pragma once

#include "../policymap/policymap.h"

// Connection states (struct flow_state.state).
enum flow_st {
	FS_SYN_SENT = 1, // the local container's SYN went out
	FS_SYN_RECV,     // a remote SYN went in
	FS_ESTABLISHED,  // a segment other than a SYN crossed
	FS_CLOSING,      // a FIN crossed
};

#define SEC_NS 1000000000ULL
// TCP flags, in the header's 14th byte.
#define TCPF_FIN 0x01
#define TCPF_SYN 0x02
#define TCPF_RST 0x04

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct flow_key);
	__type(value, struct flow_state);
	__uint(max_entries, 65536);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skc_flows SEC(".maps");

// first_packet says whether new connections may open table entries: the
// agent compiled the current policy into the maps, and no change is being
// applied (learning is not paused).
static __always_inline bool first_packet(void)
{
	__u32 key = 0;
	struct control *c = bpf_map_lookup_elem(&skc_control, &key);
	return c && !c->paused && c->policy;
}

// open_flow records a connection the policy allowed: its SYN crossed from
// the local container (outbound) or to it. A full table is the overlay's.
static __always_inline bool open_flow(struct flow_key *k, bool outbound, enum reason full)
{
	struct flow_state s = {
		.seen = bpf_ktime_get_coarse_ns(),
		.state = outbound ? FS_SYN_SENT : FS_SYN_RECV,
		.outbound = outbound,
	};
	if (bpf_map_update_elem(&skc_flows, k, &s, BPF_ANY)) {
		count(full);
		return false;
	}
	return true;
}

// track follows a table connection's segment (tcp_flags: the header's
// flags byte; fin_bit: 1 from the local container, 2 to it). A RST ends
// the entry; so does the first segment after
// a FIN in each direction (the last ACK), so that closed connections never
// fill the table. A retransmitted FIN after that takes the overlay, whose
// conntrack judges it as the start of a flow (it may reject it; the peer's
// TIME_WAIT ends anyway).
static __always_inline void track(struct flow_key *k, struct flow_state *s, __u8 tcp_flags, __u8 fin_bit)
{
	if (tcp_flags & TCPF_RST) {
		bpf_map_delete_elem(&skc_flows, k);
		return;
	}
	if (s->fin == 3 && !(tcp_flags & TCPF_FIN)) {
		bpf_map_delete_elem(&skc_flows, k);
		return;
	}
	if (tcp_flags & TCPF_FIN) {
		if (!(s->fin & fin_bit))
			s->fin |= fin_bit;
		if (s->state != FS_CLOSING)
			s->state = FS_CLOSING;
	} else if (s->state < FS_ESTABLISHED && !(tcp_flags & TCPF_SYN)) {
		s->state = FS_ESTABLISHED;
	}
	// The agent ends entries idle past conntrack's timeouts; a write per
	// second at most keeps a busy flow's cache line shared.
	__u64 now = bpf_ktime_get_coarse_ns();
	if (now - s->seen > SEC_NS)
		s->seen = now;
}

// has_listener says whether the local container of an inbound SYN has a
// socket for it in its own namespace (netns_id: the namespace's id in the
// host's). Without one the SYN takes the overlay: another layer may serve
// the address from the host stack (the sockets layer's replaced listeners),
// and a SYN to a closed port is answered there as before.
static __always_inline bool has_listener(struct __sk_buff *skb, struct flow_key *k, __s32 netns_id)
{
	if (netns_id < 0)
		return false;
	struct bpf_sock_tuple t = {.ipv4 = {.saddr = k->raddr, .daddr = k->laddr, .sport = k->rport, .dport = k->lport}};
	struct bpf_sock *sk = bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv4), (__u32)netns_id, 0);
	if (!sk)
		return false;
	bpf_sk_release(sk);
	return true;
}
