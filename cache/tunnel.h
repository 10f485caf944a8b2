// Part of cache.c (one bpf2go unit): ONCache's rewriting tunnel
// (ONCache-t, paper 002 §3.6 and Appendix F), on with --cache-tunnel
// rewrite (cfg_rewrite) toward hosts that announce it too (skc_peers).
//
// A fast-path packet between a local container a and a remote one b
// travels without VXLAN's 50 bytes: its addresses become the two hosts'
// underlay addresses, its MACs the underlay's next hop, and its IPv4 ID
// carries a restore key, K << 6 with bit 15 clear (the low six bits are
// room for GSO's per-segment increments). The receiving host gave the key
// for the pair: skc_rw_keys[{sender, K}] names (a, b), and its
// from_underlay writes them back and delivers the packet as it would have
// a decapsulated one. Keys travel in the reserved bytes of the VXLAN
// headers the fast path builds (VX_*): a pair's first packets each way go
// in VXLAN, each advertising the key its sender gave and acknowledging the
// other's; from then on the pair's packets go rewritten.
//
// What keeps a container from forging a key: every DF IPv4 packet to a
// peer that this host did not rewrite gets ID bit 15 set (scrub, in
// to_underlay; in either tunnel, so a host switched to VXLAN scrubs while
// its peers may still restore its packets), so nothing but the rewrite
// leaves with a restorable ID;
// the receiver takes a rewritten packet only from an announcing peer, with
// a live key, and only if the restored source lives on that peer.
//
// Coherency: a sender uses its key only while it hears from the peer on
// the pair (RW_HEARD_NS); a key whose pair is gone is dead — its packets
// dropped — until the agent frees it after RW_DEAD_NS without one.
#pragma once

#define IP_DF 0x4000
#define RW_KEY_SHIFT 6
#define RW_KEY_MAX 511     // nine bits: ID bits 14..6
#define RW_SCRUBBED 0x8000 // ID bit 15
#define RW_MAX_SEGS 64     // 2^RW_KEY_SHIFT: GSO's increments never reach the key
#define RW_MIN_TTL 16      // an underlay router must never expire a rewritten packet
#define RW_HEARD_NS (5 * SEC_NS)
// skb->mark of a rewritten packet (Go: cache.RewriteMark): the scrub's exemption.
#define RW_MARK 0x5c1fd
// VXLAN header byte 1 (reserved, RFC 7348), written by a rewriting fast
// path to peers and cleared by the receiver before the stack sees it.
#define VX_PEER 0x20 // built by a rewriting fast path: ACK and ADV below mean something
#define VX_ACK 0x40  // the sender holds the receiver's key for the pair
#define VX_ADV 0x80  // bytes 2-3: the sender's key for the receiver's packets of the pair

volatile const __u32 cfg_rewrite;   // --cache-tunnel rewrite
volatile const __u32 cfg_vxlan_max; // the largest inner IPv4 packet VXLAN fits in the underlay's MTU

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __be32); // a remote host's underlay address: it announces the tunnel
	__type(value, __u32);
	__uint(max_entries, 1024);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skc_peers SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct rw_pair_key);
	__type(value, struct rw_pair);
	__uint(max_entries, 16384);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skc_rw_pairs SEC(".maps");

// Not LRU: a key is freed only by the agent, RW_DEAD_NS after its pair went.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct rw_key_key);
	__type(value, struct rw_key);
	__uint(max_entries, 16384);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skc_rw_keys SEC(".maps");

static __always_inline bool announces(__be32 host)
{
	return bpf_map_lookup_elem(&skc_peers, &host) != NULL;
}

static __always_inline struct rw_pair *pair_of(__be32 local, __be32 remote, bool create)
{
	struct rw_pair_key k = {.local = local, .remote = remote};
	struct rw_pair *p = bpf_map_lookup_elem(&skc_rw_pairs, &k);
	if (p || !create)
		return p;
	struct rw_pair n = {};
	bpf_map_update_elem(&skc_rw_pairs, &k, &n, BPF_NOEXIST);
	return bpf_map_lookup_elem(&skc_rw_pairs, &k);
}

// alloc_key gives the peer a key for its packets of the pair (remote, local); 0: none left.
static __always_inline __u16 alloc_key(__be32 peer, __be32 local, __be32 remote)
{
	struct rw_key v = {.seen = bpf_ktime_get_coarse_ns(), .remote = remote, .local = local};
#pragma unroll
	for (int i = 0; i < 4; i++) {
		struct rw_key_key k = {.peer = peer, .key = bpf_get_prandom_u32() % RW_KEY_MAX + 1};
		if (bpf_map_update_elem(&skc_rw_keys, &k, &v, BPF_NOEXIST) == 0)
			return k.key;
	}
	count(EG_RW_KEYS_FULL);
	return 0;
}

static __always_inline void ip_checksum(struct iphdr *ip)
{
	ip->check = 0;
	__s64 sum = bpf_csum_diff(NULL, 0, (__be32 *)ip, sizeof(*ip), 0);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	ip->check = ~sum;
}

// readdress fixes the transport checksum of the packet whose IPv4 header
// is at off for new addresses (diff: bpf_csum_diff of old and new); the
// helper handles CHECKSUM_PARTIAL (GSO) and a UDP checksum of 0.
static __always_inline bool readdress(struct __sk_buff *skb, __u32 off, __u8 proto, __s64 diff)
{
	__u32 l4 = off + sizeof(struct iphdr);
	if (proto == IPPROTO_TCP)
		return bpf_l4_csum_replace(skb, l4 + offsetof(struct tcphdr, check), 0, diff, BPF_F_PSEUDO_HDR) == 0;
	if (proto == IPPROTO_UDP)
		return bpf_l4_csum_replace(skb, l4 + offsetof(struct udphdr, check), 0, diff,
					   BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0) == 0;
	return true; // ICMP's checksum covers no address
}

// rewrite sends a container's packet to the peer's host with the peer's
// key instead of VXLAN; -1 when the packet cannot go rewritten (it takes
// VXLAN): not DF, a DSCP (only VXLAN's inner header keeps it), a TTL an
// underlay router might expire, more GSO segments than the ID has room for.
static __always_inline int rewrite(struct __sk_buff *skb, struct egress_host *eh, __be32 peer, __u16 key, __u8 proto)
{
	if (skb->gso_segs > RW_MAX_SEGS)
		return -1;
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + ETH_HLEN;
	if ((void *)(ip + 1) > end)
		return -1;
	if (!(ip->frag_off & bpf_htons(IP_DF)) || (ip->tos & ~0x03) || ip->ttl < RW_MIN_TTL)
		return -1;
	__be32 from[2] = {ip->saddr, ip->daddr};
	__be32 to[2] = {cfg_underlay_ip, peer};
	__s64 diff = bpf_csum_diff(from, sizeof(from), to, sizeof(to), 0);
	if (!readdress(skb, ETH_HLEN, proto, diff)) {
		count(EG_ERR_ENCAP);
		return -1;
	}
	data = (void *)(long)skb->data;
	end = (void *)(long)skb->data_end;
	ip = data + ETH_HLEN;
	if ((void *)(ip + 1) > end)
		return TC_ACT_SHOT; // half-rewritten: must not leave
	__u32 ifindex = eh->ifindex;
	__builtin_memcpy(data, eh->hdr, 2 * ETH_ALEN); // the next hop's MAC and the underlay's
	ip->saddr = to[0];
	ip->daddr = to[1];
	ip->id = bpf_htons(key << RW_KEY_SHIFT);
	ip->ttl--; // the hop the overlay's forwarding would have taken
	ip_checksum(ip);
	skb->mark = RW_MARK;
	count(EG_REWRITTEN);
	return bpf_redirect(ifindex, 0);
}

// fits_vxlan says whether the container's packet (each segment of a GSO
// one) fits the underlay in VXLAN. With the rewriting tunnel containers
// have the underlay's MTU: a packet that cannot go rewritten and does not
// fit is the overlay's, whose VXLAN device sends it in outer fragments.
static __always_inline bool fits_vxlan(struct __sk_buff *skb)
{
	__u32 len = skb->len - ETH_HLEN;
	if (skb->gso_size) {
		void *data = (void *)(long)skb->data;
		void *end = (void *)(long)skb->data_end;
		struct iphdr *ip = data + ETH_HLEN;
		if ((void *)(ip + 1) > end)
			return false;
		len = skb->gso_size + sizeof(struct iphdr) + sizeof(struct udphdr);
		if (ip->protocol == IPPROTO_TCP) {
			struct tcphdr *th = (void *)(ip + 1);
			if ((void *)(th + 1) > end)
				return false;
			len = skb->gso_size + sizeof(struct iphdr) + th->doff * 4;
		}
	}
	return len <= cfg_vxlan_max;
}

// send_remote sends a fast-path packet (a hit) to a remote container's
// host: rewritten when the pair has the peer's key and hears from it, else
// in VXLAN with the pair's adverts (peer: the host's underlay address).
static __always_inline int send_remote(struct __sk_buff *skb, struct egress_host *eh, __be32 peer, struct flow_key *k)
{
	__u8 vx = 0;
	__u16 adv = 0;
	if (cfg_rewrite && announces(peer)) {
		struct rw_pair *p = pair_of(k->laddr, k->raddr, true);
		if (p) {
			if (!p->recv) {
				p->recv = alloc_key(peer, k->laddr, k->raddr);
				p->pending = p->recv != 0;
			}
			if (p->send && !p->pending && bpf_ktime_get_coarse_ns() - p->heard < RW_HEARD_NS) {
				int ret = rewrite(skb, eh, peer, p->send, k->proto);
				if (ret >= 0) {
					count(EG_HIT);
					return ret;
				}
			}
			vx = VX_PEER | (p->pending ? VX_ADV : 0) | (p->send ? VX_ACK : 0);
			adv = p->recv;
		}
		if (!fits_vxlan(skb)) {
			count(EG_TOO_BIG);
			return TC_ACT_UNSPEC;
		}
	}
	count(EG_HIT);
	return encapsulate(skb, eh, vx, adv);
}

// heard follows a pair's packet from the peer (k: the local container's
// view; rewritten, or VXLAN with the peer's flags vx and advert adv).
static __always_inline void heard(struct flow_key *k, bool rewritten, __u8 vx, __u16 adv)
{
	bool advert = (vx & VX_ADV) && adv && adv <= RW_KEY_MAX;
	struct rw_pair *p = pair_of(k->laddr, k->raddr, advert);
	if (!p)
		return;
	__u64 now = bpf_ktime_get_coarse_ns();
	if (now - p->heard > SEC_NS)
		p->heard = now;
	if (rewritten) {
		if (p->pending)
			p->pending = 0; // it sent with this host's key: it holds it
		return;
	}
	if (advert && p->send != adv)
		p->send = adv;
	if (vx & VX_ACK) {
		if (p->pending)
			p->pending = 0;
	} else if (p->recv && !p->pending) {
		p->pending = 1; // the peer lost this host's key: advertise it again
	}
}

// vx_flags reads the adverts of a VXLAN packet a peer's fast path built,
// and clears them: the VXLAN device drops a header with reserved bits set.
static __always_inline void vx_flags(struct __sk_buff *skb, __u8 *vx, __u16 *adv)
{
	__u8 *h = (void *)(long)skb->data + ETH_HLEN + sizeof(struct iphdr) + sizeof(struct udphdr);
	if ((void *)(h + 4) > (void *)(long)skb->data_end || !h[1])
		return;
	*vx = h[1];
	*adv = ((__u16)h[2] << 8) | h[3];
	h[1] = h[2] = h[3] = 0; // the fast path's VXLAN carries no UDP checksum
}

enum restored {
	RS_NOT,  // not a rewritten packet: the stack's
	RS_OK,   // restored at ETH_HLEN
	RS_DROP, // a peer's rewritten packet with no pair to restore it to
};

// restore writes the container addresses back into a peer's rewritten
// packet; *peer is the host it came from.
static __always_inline enum restored restore(struct __sk_buff *skb, __be32 *peer)
{
	if (skb->protocol != bpf_htons(ETH_P_IP) || !linear(skb, ETH_HLEN + sizeof(struct iphdr)))
		return RS_NOT;
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end)
		return RS_NOT;
	__u16 id = bpf_ntohs(ip->id);
	__u16 key = (id >> RW_KEY_SHIFT) & RW_KEY_MAX;
	if (ip->version != 4 || ip->ihl != 5 || (id & RW_SCRUBBED) || !key ||
	    (ip->frag_off & bpf_htons(IP_DF | IP_MF | IP_OFFSET)) != bpf_htons(IP_DF))
		return RS_NOT;
	__u8 proto = ip->protocol;
	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP && proto != IPPROTO_ICMP)
		return RS_NOT;
	if (ip->daddr != cfg_underlay_ip || !is_underlay_mac(eth->h_dest) || !announces(ip->saddr))
		return RS_NOT;
	__be32 from[2] = {ip->saddr, ip->daddr};
	struct rw_key_key kk = {.peer = from[0], .key = key};
	struct rw_key *v = bpf_map_lookup_elem(&skc_rw_keys, &kk);
	__u64 now = bpf_ktime_get_coarse_ns();
	if (!v) {
		// Never given (or freed since): dead from now on, so that it is
		// not given to a pair while the peer may still send with it.
		struct rw_key dead = {.seen = now, .dead = 1};
		bpf_map_update_elem(&skc_rw_keys, &kk, &dead, BPF_NOEXIST);
		count(IN_RW_UNKNOWN_KEY);
		return RS_DROP;
	}
	if (v->dead) {
		if (now - v->seen > SEC_NS)
			v->seen = now;
		count(IN_RW_DEAD_KEY);
		return RS_DROP;
	}
	__be32 to[2] = {v->remote, v->local};
	__be32 *home = bpf_map_lookup_elem(&skc_egress_ip, &to[0]);
	if (!home || *home != from[0]) {
		count(IN_RW_SPOOFED);
		return RS_DROP;
	}
	__s64 diff = bpf_csum_diff(from, sizeof(from), to, sizeof(to), 0);
	if (!readdress(skb, ETH_HLEN, proto, diff)) {
		count(IN_ERR_DECAP);
		return RS_DROP;
	}
	data = (void *)(long)skb->data;
	end = (void *)(long)skb->data_end;
	ip = data + ETH_HLEN;
	if ((void *)(ip + 1) > end)
		return RS_DROP;
	ip->saddr = to[0];
	ip->daddr = to[1];
	ip_checksum(ip);
	*peer = from[0];
	count(IN_RESTORED);
	return RS_OK;
}

// to_overlay hands a restored packet the fast path does not carry to the
// overlay, as if the VXLAN device had decapsulated it: its forwarding,
// conntrack and policy chain judge it as any other.
static __always_inline int to_overlay(struct __sk_buff *skb, __be32 peer)
{
	__u32 zero = 0;
	struct control *c = bpf_map_lookup_elem(&skc_control, &zero);
	if (!c || !c->vxlan)
		return TC_ACT_SHOT;
	__u32 vxlan = c->vxlan;
	// The VTEP MACs (overlay.VTEPMAC): 0e:5f and the underlay address.
	__u8 mac[2 * ETH_ALEN] = {0x0e, 0x5f, 0, 0, 0, 0, 0x0e, 0x5f};
	__be32 self = cfg_underlay_ip;
	__builtin_memcpy(mac + 2, &self, 4);
	__builtin_memcpy(mac + ETH_ALEN + 2, &peer, 4);
	if (bpf_skb_store_bytes(skb, 0, mac, sizeof(mac), 0))
		return TC_ACT_SHOT;
	count(IN_RW_TO_OVERLAY);
	return bpf_redirect(vxlan, BPF_F_INGRESS);
}

// scrub sets ID bit 15 on a DF IPv4 packet to a peer that is not a
// rewritten one (a host's, a host socket's, a masqueraded container's):
// only the rewrite sends a restorable ID. A GSO packet's segments count
// up from its ID: they must not wrap past 0xffff into a key.
static __always_inline void scrub(struct __sk_buff *skb)
{
	if (skb->mark == RW_MARK || skb->protocol != bpf_htons(ETH_P_IP) || !linear(skb, ETH_HLEN + sizeof(struct iphdr)))
		return;
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + ETH_HLEN;
	if ((void *)(ip + 1) > end || !(ip->frag_off & bpf_htons(IP_DF)))
		return;
	__u16 id = bpf_ntohs(ip->id);
	__u32 segs = skb->gso_segs > 1 ? skb->gso_segs : 1;
	if ((id & RW_SCRUBBED) && (__u32)id + segs - 1 <= 0xffff)
		return;
	if (!announces(ip->daddr))
		return;
	__u16 scrubbed = id | RW_SCRUBBED;
	if ((__u32)scrubbed + segs - 1 > 0xffff)
		scrubbed = RW_SCRUBBED;
	ip->id = bpf_htons(scrubbed);
	ip_checksum(ip);
	count(EI_SCRUBBED);
}
