// Part of cache.c (one bpf2go unit): the connection table, which carries a
// flow between two containers on the fast path from its first packet,
// past the overlay's conntrack and netfilter: a TCP connection from its
// SYN, and conntrack's pseudo-connections — UDP from any datagram, ICMP
// echo from a request.
//
// A flow's first packet is judged here by the policy compiled into
// policymap.h's maps, on the host it leaves (egress verdict) and on the
// host it reaches (ingress verdict), as the overlay's SKIFF-POLICY chain
// judges it on both. Only an allowed packet whose every path is known
// opens a table entry — the reply's path included, so no packet of a
// table flow ever needs the overlay — and every later packet of the flow,
// both ways, goes by the entry: the overlay's conntrack never sees the
// flow at all. Everything else (a first packet denied or not yet
// judgeable, a full table, a missing entry) takes the overlay, which
// judges as before.
#pragma once

#include "../policymap/policymap.h"

// Connection states (struct flow_state.state). UDP and ICMP use the first
// three: opened (by the local container or the other end), then replied.
enum flow_st {
	FS_SYN_SENT = 1, // the local container's SYN went out
	FS_SYN_RECV,     // a remote SYN went in
	FS_ESTABLISHED,  // TCP: a segment other than a SYN crossed; UDP, ICMP: a reply
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

// opens says whether a packet of a flow the table does not hold may open
// it: a TCP SYN (start), any UDP datagram, an ICMP echo request (fl: the
// type) — what starts a connection in conntrack.
static __always_inline bool opens(__u8 proto, bool start, __u8 fl)
{
	if (proto == IPPROTO_TCP)
		return start;
	return proto == IPPROTO_UDP || fl == ICMP_ECHO;
}

// rides says whether a packet of a flow the table holds goes by its entry
// (from_l: it comes from the key's local side): every TCP segment and UDP
// datagram does; of ICMP, the opener's echo requests and the other side's
// replies, as conntrack matches them.
static __always_inline bool rides(struct flow_state *s, __u8 proto, __u8 fl, bool from_l)
{
	if (proto != IPPROTO_ICMP)
		return true;
	bool from_opener = from_l == (s->outbound != 0);
	return fl == (from_opener ? ICMP_ECHO : ICMP_ECHOREPLY);
}

// dport is the port a rule's port matches in a flow's packet (host
// order): TCP's and UDP's destination port, none for ICMP.
static __always_inline __u16 dport(struct flow_key *k, __be16 port)
{
	return k->proto == IPPROTO_ICMP ? 0 : bpf_ntohs(port);
}

// conntrack's lookup (net/netfilter/nf_conntrack_bpf.c). struct nf_conn is
// opaque here, but a kfunc's types must match the kernel's in kind.
struct nf_conn {
	int opaque;
};
struct bpf_ct_opts {
	__s32 netns_id;
	__s32 error;
	__u8 l4proto;
	__u8 dir;
	__u16 ct_zone_id;
	__u8 ct_zone_dir;
	__u8 reserved[3];
};
extern struct nf_conn *bpf_skb_ct_lookup(struct __sk_buff *skb, struct bpf_sock_tuple *tuple, __u32 tuple__sz,
					 struct bpf_ct_opts *opts, __u32 opts__sz) __ksym;
extern void bpf_ct_release(struct nf_conn *ct) __ksym;

// tracked says whether the host's conntrack holds the UDP flow of a
// packet that would open one in the table (from_l: it comes from the
// key's local side): a flow begun on the overlay stays there, and so does
// one NAT made — a port mapping's reply looks like a new flow from the
// container, but must leave through the NAT that made it, or the client
// gets it from the wrong address. TCP opens only with a SYN, which no
// reply is; ICMP opens only with an echo request (and conntrack's lookup
// takes TCP and UDP only).
static __always_inline bool tracked(struct __sk_buff *skb, struct flow_key *k, bool from_l)
{
	if (k->proto != IPPROTO_UDP)
		return false;
	struct bpf_sock_tuple t = {.ipv4 = {.saddr = k->laddr, .daddr = k->raddr, .sport = k->lport, .dport = k->rport}};
	if (!from_l)
		t.ipv4 = (typeof(t.ipv4)){.saddr = k->raddr, .daddr = k->laddr, .sport = k->rport, .dport = k->lport};
	struct bpf_ct_opts o = {.netns_id = -1, .l4proto = IPPROTO_UDP};
	struct nf_conn *ct = bpf_skb_ct_lookup(skb, &t, sizeof(t.ipv4), &o, sizeof(o));
	if (!ct)
		return false;
	bpf_ct_release(ct);
	return true;
}

// open_flow records a flow the policy allowed: its first packet crossed
// from the local container (outbound) or to it. A full table is the
// overlay's.
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

// track follows a table flow's packet (fl: TCP's flags byte; fin_bit: 1
// from the key's local side, 2 to it). A UDP datagram or ICMP echo from
// the side that did not open the flow marks it replied. Of TCP, a RST
// ends the entry; so does the first segment after a FIN in each direction
// (the last ACK), so that closed connections never fill the table. A
// retransmitted FIN after that takes the overlay, whose conntrack judges
// it as the start of a flow (it may reject it; the peer's TIME_WAIT ends
// anyway).
static __always_inline void track(struct flow_key *k, struct flow_state *s, __u8 fl, __u8 fin_bit)
{
	if (k->proto != IPPROTO_TCP) {
		if (s->state < FS_ESTABLISHED && (fin_bit == 1) != (s->outbound != 0))
			s->state = FS_ESTABLISHED;
	} else if ((fl & TCPF_RST) || (s->fin == 3 && !(fl & TCPF_FIN))) {
		bpf_map_delete_elem(&skc_flows, k);
		return;
	} else if (fl & TCPF_FIN) {
		if (!(s->fin & fin_bit))
			s->fin |= fin_bit;
		if (s->state != FS_CLOSING)
			s->state = FS_CLOSING;
	} else if (s->state < FS_ESTABLISHED && !(fl & TCPF_SYN)) {
		s->state = FS_ESTABLISHED;
	}
	// The agent ends entries idle past conntrack's timeouts; a write per
	// second at most keeps a busy flow's cache line shared.
	__u64 now = bpf_ktime_get_coarse_ns();
	if (now - s->seen > SEC_NS)
		s->seen = now;
}

// has_listener says whether the local container of an inbound flow's first
// packet has a socket for it in its own namespace (netns_id: the
// namespace's id in the host's); an echo request needs none. Without one
// the packet takes the overlay: another layer may serve the address from
// the host stack (the sockets layer's replaced listeners), and a SYN or a
// datagram to a closed port is answered there as before.
static __always_inline bool has_listener(struct __sk_buff *skb, struct flow_key *k, __s32 netns_id)
{
	if (k->proto == IPPROTO_ICMP)
		return true;
	if (netns_id < 0)
		return false;
	struct bpf_sock_tuple t = {.ipv4 = {.saddr = k->raddr, .daddr = k->laddr, .sport = k->rport, .dport = k->lport}};
	struct bpf_sock *sk;
	if (k->proto == IPPROTO_TCP)
		sk = bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv4), (__u32)netns_id, 0);
	else
		sk = bpf_sk_lookup_udp(skb, &t, sizeof(t.ipv4), (__u32)netns_id, 0);
	if (!sk)
		return false;
	bpf_sk_release(sk);
	return true;
}
