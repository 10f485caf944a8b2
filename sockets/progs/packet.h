// Part of sockets.c (one bpf2go unit): helpers of the tc programs: headers, TOS, fragments.
#pragma once

// set_tos rewrites the TOS byte and updates the header checksum (RFC 1624).
static __always_inline void set_tos(struct iphdr *ip, __u8 tos)
{
	__u16 *word = (__u16 *)ip; // version, header length, TOS
	__u32 sum = (__u16)~ip->check + (__u16)~*word;
	ip->tos = tos;
	sum += *word;
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	ip->check = ~sum;
}

// keep_off_route takes a bit of cfg_tos off a packet for a container that
// is not steered, so that the route does not take it to the host stack.
static __always_inline void keep_off_route(struct iphdr *ip)
{
	if ((ip->tos & cfg_tos) != cfg_tos)
		return;
	set_tos(ip, ip->tos & ~(cfg_tos & -cfg_tos));
	count(SKS_TOS_CLEARED);
}

// The stack puts options written by BPF after its own, 4-byte aligned: our
// 14-byte option is followed by two bytes of padding and so always starts
// 16 bytes before the end of the TCP header. A SYN with the option anywhere
// else is treated as a plain SYN (it reaches no replaced listener).
#define SKS_OPT_FROM_END 16

// The layers' tc programs share devices with each other's (docs/layers.md):
// a packet a program does not take goes on to the device's next program
// (TC_ACT_UNSPEC), whose verdict, or none, decides. The recorder on the
// underlay takes none (it only drops forged SYNs).

// ipv4_of returns a packet's IPv4 header, or NULL for any other packet.
static __always_inline struct iphdr *ipv4_of(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data, *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return NULL;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end || ip->ihl < 5)
		return NULL;
	return ip;
}

// tcp_of returns the TCP header in ip, if all of it is direct-readable.
static __always_inline struct tcphdr *tcp_of(struct __sk_buff *skb, struct iphdr *ip)
{
	struct tcphdr *th = (void *)ip + ip->ihl * 4;
	// Keeps the compiler from merging the callers' headers into one
	// pointer whose bounds the verifier no longer knows.
	asm volatile("" : "+r"(th));
	if ((void *)(th + 1) > (void *)(long)skb->data_end)
		return NULL;
	return th;
}

// syn_of returns the TCP header of a SYN (not a SYN-ACK) in ip, or NULL.
static __always_inline struct tcphdr *syn_of(struct __sk_buff *skb, struct iphdr *ip)
{
	void *data_end = (void *)(long)skb->data_end;
	if (ip->protocol != IPPROTO_TCP)
		return NULL;
	struct tcphdr *th = (void *)ip + ip->ihl * 4;
	if ((void *)(th + 1) > data_end || !th->syn || th->ack)
		return NULL;
	return th;
}

// syn_option reads the option of a SYN into *o: whether it carries one,
// at its place.
static __always_inline bool syn_option(struct __sk_buff *skb, struct iphdr *ip, struct tcphdr *th, struct sks_opt *o)
{
	// The header must end inside the packet by the IP header's own length:
	// bytes past it (padding, or a container's trailing bytes) are cut off
	// by the stack and were never part of the SYN.
	if (th->doff * 4 < sizeof(*th) + SKS_OPT_FROM_END || ip->ihl * 4 + th->doff * 4 > bpf_ntohs(ip->tot_len))
		return false;
	__u32 off = sizeof(struct ethhdr) + ip->ihl * 4 + th->doff * 4 - SKS_OPT_FROM_END;
	return bpf_skb_load_bytes(skb, off, o, sizeof(*o)) == 0 && o->kind == SKS_OPT_KIND &&
	       o->len == SKS_OPT_LEN && o->magic == bpf_htons(SKS_OPT_MAGIC);
}

#define IP_MF 0x2000
#define IP_OFFSET 0x1fff

// fragment says whether ip is an IP fragment: the first with more to come,
// or a later one.
static __always_inline bool fragment(struct iphdr *ip) { return ip->frag_off & bpf_htons(IP_MF | IP_OFFSET); }

// underlay_fragment judges a TCP fragment on the underlay. A SYN in
// fragments is never skiff's (sockops' SYNs are 76 bytes with DF) nor any
// TCP stack's, but it is what a container's raw fragments become: its host
// reassembles them (conntrack) and sends the SYN on re-fragmented, with
// the option whole in a first fragment its own veth never saw. No fragment
// is recorded, and a first fragment that is a SYN, or too short to show
// its flags (RFC 1858's tiny fragment), is dropped, so the reassembled SYN
// never reaches the listener lookup. Later fragments pass unread (their
// bytes are no TCP header): without their first they reassemble into
// nothing. The host's other fragmented TCP passes.
static __always_inline int underlay_fragment(struct __sk_buff *skb, struct iphdr *ip)
{
	if (ip->frag_off & bpf_htons(IP_OFFSET))
		return TC_ACT_UNSPEC;
	__u32 ihl = ip->ihl * 4;
	// By the IP length, not data_end: a tiny fragment's frame is padded.
	if (bpf_ntohs(ip->tot_len) < ihl + sizeof(struct tcphdr))
		goto drop;
	struct tcphdr copy, *th = tcp_of(skb, ip);
	if (!th) { // in paged data (a driver that pulled less): copied
		if (bpf_skb_load_bytes(skb, sizeof(struct ethhdr) + ihl, &copy, sizeof(copy)))
			goto drop;
		th = &copy;
	}
	if (!th->syn || th->ack)
		return TC_ACT_UNSPEC;
drop:
	count(SKS_TCP_FRAGMENT);
	return TC_ACT_SHOT;
}
