//go:build ignore

// skiff's cache layer: the ONCache fast path (NSDI '25) in front of the
// standard VXLAN overlay.
//
// Four tc programs share the maps below, flows.h's and tunnel.h's:
//   from_container  tc ingress of a container's host-side veth: egress fast
//                   path (encapsulate from cached headers, or rewrite with
//                   tunnel.h's rewriting tunnel; redirect to the underlay
//                   device).
//   from_underlay   tc ingress of the underlay device: ingress fast path
//                   (decapsulate, or restore a rewritten packet;
//                   redirect_peer into the container).
//   to_underlay     tc egress of the underlay device: scrubs what a tunnel
//                   peer could take for rewritten (tunnel.h), and is the
//                   egress-init: learns the
//                   outer headers the overlay built for marked packets.
//   to_container    tc ingress of the container-side veth (inside the
//                   container's namespace): ingress-init, learns the MACs the
//                   overlay delivered marked packets with.
//
// A packet the fast path cannot carry goes to the overlay untouched or, when
// a cache entry is what is missing, with the "miss" mark in its (inner) IP
// header. The overlay's conntrack rule adds the "established" mark to missed
// packets of established flows. The init programs learn only from packets
// carrying both marks and clear the marks of every overlay packet they see,
// so marks never leave the overlay. Anything not fully understood (non-IPv4,
// IP options, fragments, truncated headers, TCP SYN/FIN/RST, ICMP other than
// echo) is left to the overlay without a mark.

#include <stdbool.h>
#include <stddef.h>
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "cache.h"

char __license[] SEC("license") = "GPL";

#ifndef BPF_F_ADJ_ROOM_ENCAP_L2_ETH
#define BPF_F_ADJ_ROOM_ENCAP_L2_ETH (1ULL << 6)
#endif

#define VXLAN_HLEN 8
#define VXLAN_FLAG_VNI 0x08
// Outer IPv4 + UDP + VXLAN + inner Ethernet: what encapsulation adds.
#define ENCAP_LEN (sizeof(struct iphdr) + sizeof(struct udphdr) + VXLAN_HLEN + ETH_HLEN)
#define INNER_IP_OFF (ETH_HLEN + ENCAP_LEN)
#define IP_CSUM_OFF offsetof(struct iphdr, check)
#define IP_TTL_OFF offsetof(struct iphdr, ttl)
#define ICMP_ECHOREPLY 0
#define ICMP_ECHO 8
// linux/icmp.h drags in libc headers; the fast path needs only this much.
struct icmphdr {
	__u8 type;
	__u8 code;
	__sum16 checksum;
	__be16 id;
	__be16 sequence;
};

#define IP_MF 0x2000
#define IP_OFFSET 0x1fff

// Configuration, set by the agent before load.
volatile const __be32 cfg_cluster_net;    // cluster CIDR
volatile const __be32 cfg_cluster_mask;
volatile const __be32 cfg_local_net;      // this host's subnet
volatile const __be32 cfg_local_mask;
volatile const __be32 cfg_underlay_ip;    // this host's underlay address
volatile const __u8 cfg_underlay_mac[ETH_ALEN];
volatile const __be16 cfg_vxlan_port;     // network order
volatile const __u32 cfg_vni;             // host order
volatile const __u32 cfg_port_min;        // UDP source port range of the
volatile const __u32 cfg_port_max;        // overlay (the netns' local port range)

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, __be32);   // remote container address
	__type(value, __be32); // its host's underlay address
	__uint(max_entries, 4096);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skc_egress_ip SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, __be32); // remote host underlay address
	__type(value, struct egress_host);
	__uint(max_entries, 1024);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skc_egress_host SEC(".maps");

// Written by the agent alone (at ADD, removed at DEL): a plain hash, so
// that no entry is ever evicted behind its back; a full map fails the
// ADD's attach and the container takes the overlay.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __be32); // local container address
	__type(value, struct ingress_ep);
	__uint(max_entries, 1024);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skc_ingress SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct flow_key);
	__type(value, struct filter_val);
	__uint(max_entries, 16384);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skc_filter SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, NR_REASONS);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skc_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct control);
	__uint(max_entries, 1);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skc_control SEC(".maps");

// Keeps the reason enum in BTF: Go names the counters by its constants.
const enum reason *unused_reason __attribute__((unused));

static __always_inline void count(enum reason r)
{
	__u32 key = r;
	__u64 *v = bpf_map_lookup_elem(&skc_stats, &key);
	if (v)
		*v += 1;
}

static __always_inline bool learning(void)
{
	__u32 key = 0;
	struct control *c = bpf_map_lookup_elem(&skc_control, &key);
	return c && !c->paused;
}

static __always_inline bool in_cluster(__be32 a)
{
	return (a & cfg_cluster_mask) == cfg_cluster_net;
}

static __always_inline bool is_local(__be32 a)
{
	return (a & cfg_local_mask) == cfg_local_net;
}

// Ensure len bytes are in the linear part of the packet.
static __always_inline bool linear(struct __sk_buff *skb, __u32 len)
{
	if ((void *)(long)skb->data + len <= (void *)(long)skb->data_end)
		return true;
	return len <= skb->len && bpf_skb_pull_data(skb, len) == 0 &&
	       (void *)(long)skb->data + len <= (void *)(long)skb->data_end;
}

enum parse {
	PARSE_OK,
	PARSE_START,       // TCP SYN: a flow (re)starts; conntrack must see it
	PARSE_CONTROL,     // TCP SYN-ACK/FIN/RST: conntrack must see it
	PARSE_UNSUPPORTED, // options, fragment, protocol, truncated
};

// parse_ip reads the IPv4 header at off and its ports into key, oriented
// with the source as the local side (an ICMP echo's identifier stands for
// both ports, as in conntrack's tuple), and into fl TCP's flags byte or
// ICMP's type. The caller has made off+20 linear.
static __always_inline enum parse parse_ip(struct __sk_buff *skb, __u32 off, struct flow_key *key, __u8 *tos, __u8 *ttl,
					    __u8 *fl)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + off;
	if ((void *)(ip + 1) > end)
		return PARSE_UNSUPPORTED;
	if (ip->version != 4 || ip->ihl != 5)
		return PARSE_UNSUPPORTED;
	if (ip->frag_off & bpf_htons(IP_MF | IP_OFFSET))
		return PARSE_UNSUPPORTED;
	*tos = ip->tos;
	*ttl = ip->ttl;
	key->laddr = ip->saddr;
	key->raddr = ip->daddr;
	key->proto = ip->protocol;
	key->lport = 0;
	key->rport = 0;
	__u32 l4 = off + sizeof(struct iphdr);
	switch (ip->protocol) {
	case IPPROTO_TCP: {
		if (!linear(skb, l4 + sizeof(struct tcphdr)))
			return PARSE_UNSUPPORTED;
		data = (void *)(long)skb->data;
		end = (void *)(long)skb->data_end;
		struct tcphdr *th = data + l4;
		if ((void *)(th + 1) > end)
			return PARSE_UNSUPPORTED;
		key->lport = th->source;
		key->rport = th->dest;
		*fl = ((__u8 *)th)[13];
		if (th->syn && !th->ack)
			return PARSE_START;
		if (th->syn || th->fin || th->rst)
			return PARSE_CONTROL;
		return PARSE_OK;
	}
	case IPPROTO_UDP: {
		if (!linear(skb, l4 + sizeof(struct udphdr)))
			return PARSE_UNSUPPORTED;
		data = (void *)(long)skb->data;
		end = (void *)(long)skb->data_end;
		struct udphdr *uh = data + l4;
		if ((void *)(uh + 1) > end)
			return PARSE_UNSUPPORTED;
		key->lport = uh->source;
		key->rport = uh->dest;
		return PARSE_OK;
	}
	case IPPROTO_ICMP: {
		if (!linear(skb, l4 + sizeof(struct icmphdr)))
			return PARSE_UNSUPPORTED;
		data = (void *)(long)skb->data;
		end = (void *)(long)skb->data_end;
		struct icmphdr *ih = data + l4;
		if ((void *)(ih + 1) > end)
			return PARSE_UNSUPPORTED;
		// Errors are RELATED traffic conntrack must see; only echo is cached.
		if (ih->type != ICMP_ECHO && ih->type != ICMP_ECHOREPLY)
			return PARSE_UNSUPPORTED;
		key->lport = ih->id;
		key->rport = ih->id;
		*fl = ih->type;
		return PARSE_OK;
	}
	}
	return PARSE_UNSUPPORTED;
}

static __always_inline void swap_key(struct flow_key *k)
{
	__be32 a = k->laddr;
	k->laddr = k->raddr;
	k->raddr = a;
	__be16 p = k->lport;
	k->lport = k->rport;
	k->rport = p;
}

#include "flows.h"

// set_tos rewrites the TOS byte of the IPv4 header at off, fixing its checksum.
static __always_inline int set_tos(struct __sk_buff *skb, __u32 off, __u8 old, __u8 new)
{
	if (old == new)
		return 0;
	// TOS is the low byte of the header's first 16-bit word.
	int err = bpf_l3_csum_replace(skb, off + IP_CSUM_OFF, bpf_htons(old), bpf_htons(new), 2);
	if (err)
		return err;
	return bpf_skb_store_bytes(skb, off + offsetof(struct iphdr, tos), &new, 1, 0);
}

// decrease_ttl stands in for the forwarding hop the fast path skips, with the
// kernel's incremental checksum update (ip_decrease_ttl()).
static __always_inline void decrease_ttl(struct iphdr *ip)
{
	__u32 check = (__u32)ip->check;
	check += (__u32)bpf_htons(0x0100);
	ip->check = (__sum16)(check + (check >= 0xFFFF));
	ip->ttl--;
}

// forget_flow drops what the filter and the table hold for a flow whose SYN
// is seen: a connection that reuses the 4-tuple of an ended one starts
// unknown (an allowed SYN opens it again in the table). It may
// take another path than the overlay's forwarding, which the caches never
// learn (a host socket's connection, steered to the host stack by the
// sockets layer): a stale entry would otherwise put its packets into the
// container. Looked up first: a delete takes the bucket's lock even for
// nothing.
static __always_inline void forget_flow(struct flow_key *k, enum reason r)
{
	if (bpf_map_lookup_elem(&skc_filter, k) && bpf_map_delete_elem(&skc_filter, k) == 0)
		count(r);
	if (bpf_map_lookup_elem(&skc_flows, k))
		bpf_map_delete_elem(&skc_flows, k);
}

static __always_inline bool filter_open(struct flow_key *k)
{
	struct filter_val *f = bpf_map_lookup_elem(&skc_filter, k);
	return f && f->egress && f->ingress;
}

// The kernel's udp_flow_src_port(): the overlay device picks the outer UDP
// source port from the inner flow's hash this way, so a flow keeps its outer
// port (and its underlay ECMP path) when it moves to the fast path.
static __always_inline __be16 flow_src_port(__u32 hash)
{
	hash ^= hash << 16;
	return bpf_htons((__u16)((((__u64)hash * (cfg_port_max - cfg_port_min)) >> 32) + cfg_port_min));
}

// clear_forged_marks takes skiff's marks off a container's packet to the
// cluster: the marks are the data path's, and a container that set them
// itself would have the init programs learn a flow conntrack never let
// through. (Traffic leaving the cluster keeps its DSCP: nothing reads the
// marks there.) The caller has made the IPv4 header linear.
static __always_inline void clear_forged_marks(struct __sk_buff *skb)
{
	struct iphdr *ip = (void *)(long)skb->data + ETH_HLEN;
	if ((void *)(ip + 1) > (void *)(long)skb->data_end)
		return;
	__u8 tos = ip->tos;
	if (!(tos & MARKS) || !in_cluster(ip->daddr))
		return;
	set_tos(skb, ETH_HLEN, tos, tos & ~MARKS);
	count(EG_FORGED_MARKS);
}

// egress_path returns the headers to a remote container's host, when the
// reply can take the fast path too (the local container's ingress entry is
// complete), so the overlay's conntrack never sees one direction of a flow
// without the other; NULL otherwise, with the missing piece counted.
static __always_inline struct egress_host *egress_path(struct flow_key *k, enum reason *miss, __be32 *peer)
{
	__be32 *host = bpf_map_lookup_elem(&skc_egress_ip, &k->raddr);
	if (!host) {
		*miss = EG_MISS_EGRESS_IP;
		return NULL;
	}
	*peer = *host;
	struct egress_host *eh = bpf_map_lookup_elem(&skc_egress_host, host);
	if (!eh) {
		*miss = EG_MISS_EGRESS_HOST;
		return NULL;
	}
	struct ingress_ep *self = bpf_map_lookup_elem(&skc_ingress, &k->laddr);
	if (!self || !self->ready) {
		*miss = EG_PASS_REVERSE;
		return NULL;
	}
	return eh;
}

// encapsulate puts eh's headers in front of a container's packet and sends
// it out of the underlay device; vx and adv go in the VXLAN header's
// reserved bytes (tunnel.h).
static __always_inline int encapsulate(struct __sk_buff *skb, struct egress_host *eh, __u8 vx, __u16 adv)
{
	__u32 ifindex = eh->ifindex;
	__u32 hash = bpf_get_hash_recalc(skb);
	// FIXED_GSO: the container MTU already leaves room for the 50 bytes, so
	// the segments' MSS stays as it is; the ENCAP flags make GSO segment the
	// packet as a UDP tunnel.
	if (bpf_skb_adjust_room(skb, ENCAP_LEN, BPF_ADJ_ROOM_MAC,
				BPF_F_ADJ_ROOM_FIXED_GSO | BPF_F_ADJ_ROOM_ENCAP_L3_IPV4 | BPF_F_ADJ_ROOM_ENCAP_L4_UDP |
					BPF_F_ADJ_ROOM_ENCAP_L2_ETH | BPF_F_ADJ_ROOM_ENCAP_L2(ETH_HLEN))) {
		count(EG_ERR_ENCAP);
		return TC_ACT_UNSPEC;
	}
	// Direct packet writes: adjust_room left the headers linear and writable.
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	if (data + INNER_IP_OFF + sizeof(struct iphdr) > end) {
		count(EG_ERR_ENCAP);
		return TC_ACT_SHOT; // half-built headers must not leave
	}
	__builtin_memcpy(data, eh->hdr, sizeof(eh->hdr));
	struct iphdr *oip = data + ETH_HLEN;
	struct udphdr *ouh = (void *)(oip + 1);
	oip->tot_len = bpf_htons(skb->len - ETH_HLEN);
	oip->id = (__be16)bpf_get_prandom_u32();
	oip->check = 0;
	__s64 sum = bpf_csum_diff(NULL, 0, (__be32 *)oip, sizeof(*oip), 0);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	oip->check = ~sum;
	ouh->len = bpf_htons(skb->len - ETH_HLEN - sizeof(struct iphdr));
	ouh->source = flow_src_port(hash);
	ouh->check = 0; // the overlay device sends zero UDP checksums too
	__u8 *vxh = (void *)(ouh + 1);
	vxh[1] = vx;
	vxh[2] = adv >> 8;
	vxh[3] = adv;
	decrease_ttl(data + INNER_IP_OFF);
	return bpf_redirect(ifindex, 0);
}

static __always_inline bool is_underlay_mac(const __u8 *mac)
{
	bool same = true;
#pragma unroll
	for (int i = 0; i < ETH_ALEN; i++)
		same &= mac[i] == cfg_underlay_mac[i];
	return same;
}

#include "tunnel.h"

// egress_open judges the first packet of a local container's flow to a
// remote one (a SYN, a datagram, an echo request) and opens the flow in
// the table; NULL sends the packet to the overlay.
static __always_inline struct egress_host *egress_open(struct __sk_buff *skb, struct flow_key *k, __be32 *peer)
{
	if (!first_packet()) {
		count(EG_NEW_UNJUDGED);
		return NULL;
	}
	int v = skp_verdict(&skp_egress, k->laddr, k->raddr, k->proto, dport(k, k->rport));
	if (v != SKP_ALLOW) {
		count(v == SKP_DENY ? EG_NEW_DENIED : EG_NEW_UNJUDGED);
		return NULL;
	}
	enum reason miss;
	struct egress_host *eh = egress_path(k, &miss, peer);
	if (!eh) {
		count(EG_NO_PATH);
		return NULL;
	}
	if (tracked(skb, k, true)) {
		count(EG_NEW_TRACKED);
		return NULL;
	}
	if (!open_flow(k, true, EG_TABLE_FULL))
		return NULL;
	count(EG_TABLE_OPEN);
	return eh;
}

#include "local.h"

SEC("tc")
int from_container(struct __sk_buff *skb)
{
	if (skb->protocol != bpf_htons(ETH_P_IP)) {
		count(EG_PASS_NOT_IP);
		return TC_ACT_UNSPEC;
	}
	if (!linear(skb, ETH_HLEN + sizeof(struct iphdr))) {
		count(EG_PASS_UNSUPPORTED);
		return TC_ACT_UNSPEC;
	}
	clear_forged_marks(skb);
	struct flow_key key = {};
	__u8 tos = 0, ttl = 0, fl = 0;
	enum parse p = parse_ip(skb, ETH_HLEN, &key, &tos, &ttl, &fl);
	if (p == PARSE_UNSUPPORTED) {
		count(EG_PASS_UNSUPPORTED);
		return TC_ACT_UNSPEC;
	}
	// Container-to-host traffic and traffic leaving the cluster are the
	// overlay's; flows between containers of this host go by the table.
	if (!in_cluster(key.raddr)) {
		count(EG_PASS_NOT_REMOTE);
		return TC_ACT_UNSPEC;
	}
	if (is_local(key.raddr))
		return local_flow(skb, &key, p, fl);
	if (p == PARSE_START)
		forget_flow(&key, EG_FLOW_FORGOTTEN);
	if (ttl <= 1) {
		count(EG_PASS_TTL);
		return TC_ACT_UNSPEC;
	}
	// The connection table first: a flow it holds goes by its entry, a
	// packet that may open one is judged.
	enum reason miss;
	struct egress_host *eh;
	__be32 peer = 0;
	struct flow_state *s = bpf_map_lookup_elem(&skc_flows, &key);
	if (s && rides(s, key.proto, fl, true)) {
		eh = egress_path(&key, &miss, &peer);
		if (!eh) {
			count(EG_NO_PATH);
			return TC_ACT_UNSPEC;
		}
		track(&key, s, fl, 1);
		count(EG_TABLE_HIT);
		return send_remote(skb, eh, peer, &key);
	}
	if (!s && opens(key.proto, p == PARSE_START, fl)) {
		eh = egress_open(skb, &key, &peer);
		if (eh) {
			count(EG_TABLE_HIT);
			return send_remote(skb, eh, peer, &key);
		}
		if (p == PARSE_START)
			return TC_ACT_UNSPEC; // the overlay's conntrack must see it
	}
	if (p != PARSE_OK) {
		count(EG_PASS_CONTROL);
		return TC_ACT_UNSPEC;
	}
	if (!filter_open(&key)) {
		miss = EG_MISS_FILTER;
		goto mark;
	}
	eh = egress_path(&key, &miss, &peer);
	if (!eh) {
		if (miss == EG_PASS_REVERSE) {
			count(EG_PASS_REVERSE);
			return TC_ACT_UNSPEC;
		}
		goto mark;
	}
	return send_remote(skb, eh, peer, &key);

mark:
	count(miss);
	if (!(tos & MARK_MISS))
		set_tos(skb, ETH_HLEN, tos, tos | MARK_MISS);
	return TC_ACT_UNSPEC;
}

// vxlan_inner checks that the packet is VXLAN for this host's overlay and
// returns true with the inner IPv4 header at INNER_IP_OFF made linear.
static __always_inline bool vxlan_inner(struct __sk_buff *skb, struct iphdr *outer)
{
	if (skb->protocol != bpf_htons(ETH_P_IP))
		return false;
	if (!linear(skb, INNER_IP_OFF + sizeof(struct iphdr)))
		return false;
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + ETH_HLEN;
	struct udphdr *uh = (void *)(ip + 1);
	__u8 *vx = (void *)(uh + 1);
	struct ethhdr *ieth = (void *)(vx + VXLAN_HLEN);
	if ((void *)(ieth + 1) > end)
		return false;
	if (ip->version != 4 || ip->ihl != 5 || ip->protocol != IPPROTO_UDP ||
	    (ip->frag_off & bpf_htons(IP_MF | IP_OFFSET)))
		return false;
	if (uh->dest != cfg_vxlan_port || !(vx[0] & VXLAN_FLAG_VNI))
		return false;
	__u32 vni = ((__u32)vx[4] << 16) | ((__u32)vx[5] << 8) | vx[6];
	if (vni != cfg_vni || ieth->h_proto != bpf_htons(ETH_P_IP))
		return false;
	*outer = *ip;
	return true;
}

// deliver takes the outer headers off a packet for a local container and
// hands it to the container's namespace.
static __always_inline int deliver(struct __sk_buff *skb, struct ingress_ep *ep, bool rewritten)
{
	__u32 ifindex = ep->ifindex;
	bool shaped = ep->shaped;
	__u8 mac[2 * ETH_ALEN];
	__builtin_memcpy(mac, ep->mac_dst, ETH_ALEN);
	__builtin_memcpy(mac + ETH_ALEN, ep->mac_src, ETH_ALEN);
	// Pop outer IPv4, UDP, VXLAN and the inner Ethernet header; the outer
	// Ethernet header stays (both carry IPv4) and gets the container's MACs.
	// FIXED_GSO: the inner segments' MSS does not change with decapsulation.
	// A restored packet (tunnel.h) has no outer headers.
	if (!rewritten && bpf_skb_adjust_room(skb, -(__s32)ENCAP_LEN, BPF_ADJ_ROOM_MAC, BPF_F_ADJ_ROOM_FIXED_GSO)) {
		count(IN_ERR_DECAP);
		return TC_ACT_UNSPEC;
	}
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	if (data + ETH_HLEN + sizeof(struct iphdr) > end) {
		count(IN_ERR_DECAP);
		return TC_ACT_SHOT;
	}
	__builtin_memcpy(data, mac, sizeof(mac));
	decrease_ttl(data + ETH_HLEN);
	// A container with an ingress rate limit gets its packets through the
	// host veth's egress, where the limit's qdisc is (redirect_peer would
	// skip it): the limit holds on the fast path too.
	if (shaped) {
		count(IN_HIT_SHAPED);
		return bpf_redirect(ifindex, 0);
	}
	return bpf_redirect_peer(ifindex, 0);
}

// ingress_path returns a local container's complete ingress entry when
// the reply to key's packet can take the fast path too (from: the host
// the sender lives on, checked already); NULL otherwise.
static __always_inline struct ingress_ep *ingress_path(struct flow_key *k, __be32 *from)
{
	if (!from)
		return NULL;
	struct ingress_ep *ep = bpf_map_lookup_elem(&skc_ingress, &k->laddr);
	if (!ep || !ep->ready || !bpf_map_lookup_elem(&skc_egress_host, from))
		return NULL;
	return ep;
}

// ingress_open judges the first packet of a remote container's flow to a
// local one (its source checked already) and opens the flow in the table;
// NULL sends the packet to the overlay.
static __always_inline struct ingress_ep *ingress_open(struct __sk_buff *skb, struct flow_key *k, __be32 *from)
{
	if (!first_packet()) {
		count(IN_NEW_UNJUDGED);
		return NULL;
	}
	int v = skp_verdict(&skp_ingress, k->laddr, k->raddr, k->proto, dport(k, k->lport));
	if (v != SKP_ALLOW) {
		count(v == SKP_DENY ? IN_NEW_DENIED : IN_NEW_UNJUDGED);
		return NULL;
	}
	struct ingress_ep *ep = ingress_path(k, from);
	if (!ep) {
		count(IN_NO_PATH);
		return NULL;
	}
	if (!has_listener(skb, k, ep->netns_id)) {
		count(IN_NEW_NO_LISTENER);
		return NULL;
	}
	if (tracked(skb, k, false)) {
		count(IN_NEW_TRACKED);
		return NULL;
	}
	if (!open_flow(k, false, IN_TABLE_FULL))
		return NULL;
	count(IN_TABLE_OPEN);
	return ep;
}

// pass leaves a packet the fast path does not carry to the stack: a
// restored one (rewritten) to the overlay's VXLAN device, from peer.
static __always_inline int pass(struct __sk_buff *skb, bool rewritten, __be32 peer)
{
	return rewritten ? to_overlay(skb, peer) : TC_ACT_UNSPEC;
}

SEC("tc")
int from_underlay(struct __sk_buff *skb)
{
	struct iphdr outer = {};
	__u32 off = INNER_IP_OFF;
	__u8 vx = 0;
	__u16 adv = 0;
	bool rw = false;
	if (vxlan_inner(skb, &outer)) {
		struct ethhdr *eth = (void *)(long)skb->data;
		if ((void *)(eth + 1) > (void *)(long)skb->data_end)
			return TC_ACT_UNSPEC;
		if (outer.daddr != cfg_underlay_ip || !is_underlay_mac(eth->h_dest)) {
			count(IN_PASS_NOT_MINE);
			return TC_ACT_UNSPEC;
		}
		if (cfg_rewrite)
			vx_flags(skb, &vx, &adv);
	} else {
		enum restored r = cfg_rewrite ? restore(skb, &outer.saddr) : RS_NOT;
		if (r == RS_NOT) {
			count(IN_PASS_NOT_VXLAN);
			return TC_ACT_UNSPEC;
		}
		if (r == RS_DROP)
			return TC_ACT_SHOT;
		off = ETH_HLEN;
		rw = true;
	}
	struct flow_key key = {};
	__u8 tos = 0, ttl = 0, fl = 0;
	enum parse p = parse_ip(skb, off, &key, &tos, &ttl, &fl);
	if (p == PARSE_UNSUPPORTED) {
		count(IN_PASS_UNSUPPORTED);
		return pass(skb, rw, outer.saddr);
	}
	swap_key(&key); // local side is the destination
	if (!is_local(key.laddr)) {
		count(IN_PASS_NOT_MINE);
		return pass(skb, rw, outer.saddr);
	}
	// Anti-spoofing: the inner source must be a container this host would
	// send to through the very host the packet came from. Nothing else
	// changes state or takes the fast path. (restore checked it already.)
	__be32 *from = bpf_map_lookup_elem(&skc_egress_ip, &key.raddr);
	bool checked = from && *from == outer.saddr;
	if (cfg_rewrite && checked && (rw || (vx & VX_PEER)))
		heard(&key, rw, vx, adv);
	// A SYN forgets its flow only when it may come from where it claims:
	// a forged SYN must not take a live flow off the fast path. With no
	// entry for the source, the flow takes no fast path either way.
	if (p == PARSE_START && (!from || checked))
		forget_flow(&key, IN_FLOW_FORGOTTEN);
	if (ttl <= 1) {
		count(IN_PASS_TTL);
		return pass(skb, rw, outer.saddr);
	}
	struct ingress_ep *ep;
	if (checked) {
		struct flow_state *s = bpf_map_lookup_elem(&skc_flows, &key);
		if (s && rides(s, key.proto, fl, false)) {
			ep = ingress_path(&key, from);
			if (!ep) {
				count(IN_NO_PATH);
				return pass(skb, rw, outer.saddr);
			}
			track(&key, s, fl, 2);
			count(IN_HIT);
			count(IN_TABLE_HIT);
			return deliver(skb, ep, rw);
		}
		if (!s && opens(key.proto, p == PARSE_START, fl)) {
			ep = ingress_open(skb, &key, from);
			if (ep) {
				count(IN_HIT);
				count(IN_TABLE_HIT);
				return deliver(skb, ep, rw);
			}
			if (p == PARSE_START)
				return pass(skb, rw, outer.saddr);
		}
	}
	if (p != PARSE_OK) {
		count(IN_PASS_CONTROL);
		return pass(skb, rw, outer.saddr);
	}
	enum reason miss;
	if (!filter_open(&key)) {
		miss = IN_MISS_FILTER;
		goto mark;
	}
	ep = bpf_map_lookup_elem(&skc_ingress, &key.laddr);
	if (!ep || !ep->ready) {
		miss = IN_MISS_INGRESS;
		goto mark;
	}
	if (!checked) {
		count(IN_PASS_REVERSE);
		return TC_ACT_UNSPEC;
	}
	count(IN_HIT);
	return deliver(skb, ep, rw);

mark:
	count(miss);
	if (!(tos & MARK_MISS)) {
		set_tos(skb, off, tos, tos | MARK_MISS);
		// The inner header changed: a UDP checksum over it would be wrong.
		__be16 zero = 0;
		if (!rw)
			bpf_skb_store_bytes(skb, ETH_HLEN + sizeof(struct iphdr) + offsetof(struct udphdr, check), &zero, 2, 0);
	}
	return pass(skb, rw, outer.saddr);
}

SEC("tc")
int to_underlay(struct __sk_buff *skb)
{
	scrub(skb);
	struct iphdr outer;
	if (!vxlan_inner(skb, &outer)) {
		count(EI_PASS);
		return TC_ACT_UNSPEC;
	}
	// Only what the overlay forwarded into its VXLAN device is the
	// overlay's: a VXLAN frame a container (or a host process) sent to some
	// address looks the same here, and learning from it would send every
	// cached flow to the victim wherever its outer header says.
	if (!(skb->mark & LEARN_MARK)) {
		count(EI_PASS_NOT_OVERLAY);
		return TC_ACT_UNSPEC;
	}
	struct flow_key key = {};
	__u8 tos = 0, ttl = 0, fl = 0;
	enum parse p = parse_ip(skb, INNER_IP_OFF, &key, &tos, &ttl, &fl);
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct iphdr *iip = data + INNER_IP_OFF;
	if ((void *)(iip + 1) > end)
		return TC_ACT_UNSPEC;
	tos = iip->tos;
	if (!(tos & MARKS)) {
		count(EI_PASS); // fast-path packets and unmarked overlay traffic
		return TC_ACT_UNSPEC;
	}
	if ((tos & MARKS) != MARKS || p != PARSE_OK) {
		count(EI_CLEARED);
	} else if (!learning()) {
		count(EI_PAUSED);
	} else {
		struct egress_host eh = {.ifindex = skb->ifindex};
		if (bpf_skb_load_bytes(skb, 0, eh.hdr, sizeof(eh.hdr)) == 0) {
			bpf_map_update_elem(&skc_egress_host, &outer.daddr, &eh, BPF_ANY);
			bpf_map_update_elem(&skc_egress_ip, &key.raddr, &outer.daddr, BPF_ANY);
			struct filter_val *f = bpf_map_lookup_elem(&skc_filter, &key);
			if (f) {
				f->egress = 1;
			} else {
				struct filter_val nf = {.egress = 1};
				bpf_map_update_elem(&skc_filter, &key, &nf, BPF_NOEXIST);
			}
			count(EI_LEARN);
		}
	}
	set_tos(skb, INNER_IP_OFF, tos, tos & ~MARKS);
	return TC_ACT_UNSPEC;
}

SEC("tc")
int to_container(struct __sk_buff *skb)
{
	if (skb->protocol != bpf_htons(ETH_P_IP) || !linear(skb, ETH_HLEN + sizeof(struct iphdr))) {
		count(II_PASS);
		return TC_ACT_UNSPEC;
	}
	struct flow_key key = {};
	__u8 tos = 0, ttl = 0, fl = 0;
	enum parse p = parse_ip(skb, ETH_HLEN, &key, &tos, &ttl, &fl);
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end)
		return TC_ACT_UNSPEC;
	tos = ip->tos;
	if (!(tos & MARKS)) {
		count(II_PASS);
		return TC_ACT_UNSPEC;
	}
	swap_key(&key); // local side is the destination
	struct ingress_ep *ep = bpf_map_lookup_elem(&skc_ingress, &key.laddr);
	if ((tos & MARKS) != MARKS || p != PARSE_OK || !ep) {
		count(II_CLEARED);
	} else if (!learning()) {
		count(II_PAUSED);
	} else {
		__builtin_memcpy(ep->mac_dst, eth->h_dest, ETH_ALEN);
		__builtin_memcpy(ep->mac_src, eth->h_source, ETH_ALEN);
		ep->ready = 1;
		struct filter_val *f = bpf_map_lookup_elem(&skc_filter, &key);
		if (f) {
			f->ingress = 1;
		} else {
			struct filter_val nf = {.ingress = 1};
			bpf_map_update_elem(&skc_filter, &key, &nf, BPF_NOEXIST);
		}
		count(II_LEARN);
	}
	set_tos(skb, ETH_HLEN, tos, tos & ~MARKS);
	return TC_ACT_UNSPEC;
}
