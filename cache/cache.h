// Types shared by the cache programs and the agent (bpf2go generates the Go
// side from them).
#pragma once

#define MARK_MISS 0x04 // TOS bit 2 (DSCP bit 0): the fast path missed
#define MARK_EST 0x08  // TOS bit 3 (DSCP bit 1): the overlay's conntrack says established
#define MARKS (MARK_MISS | MARK_EST)
// skb mark bit the overlay's mangle rule sets on every overlay packet it
// forwards into the VXLAN device (which keeps skb->mark within a namespace):
// to_underlay learns only from packets carrying it. Go: cache.LearnMark.
#define LEARN_MARK 0x1000

// A flow as seen from this host: l* is the local container's side.
struct flow_key {
	__be32 laddr;
	__be32 raddr;
	__be16 lport;
	__be16 rport;
	__u8 proto;
	__u8 pad[3];
};

// Which directions of a flow the overlay has let through as established.
struct filter_val {
	__u8 egress;
	__u8 ingress;
	__u8 pad[2];
};

// The headers the overlay put in front of a packet to one remote host:
// outer Ethernet, IPv4, UDP, VXLAN and the inner Ethernet header.
struct egress_host {
	__u8 hdr[64];
	__u32 ifindex; // underlay device
	__u32 pad;
};

// How the overlay delivers to a local container.
struct ingress_ep {
	__u32 ifindex; // host-side veth (redirect_peer target)
	__u8 mac_dst[6];
	__u8 mac_src[6];
	__u8 ready;  // MACs learned
	__u8 shaped; // an ingress rate limit: deliver through the veth's qdisc
	__u8 pad[2];
};

struct control {
	__u32 paused; // learning paused (delete-and-reinitialize in progress)
};

// Counters, one per program outcome. Names in Go: cache/stats.go.
enum reason {
	EG_HIT,
	EG_PASS_NOT_IP,
	EG_PASS_UNSUPPORTED,
	EG_PASS_NOT_REMOTE,
	EG_PASS_CONTROL,
	EG_PASS_TTL,
	EG_PASS_REVERSE,
	EG_MISS_FILTER,
	EG_MISS_EGRESS_IP,
	EG_MISS_EGRESS_HOST,
	EG_ERR_ENCAP,
	EG_FORGED_MARKS, // counted besides the outcome: a container's own marks, cleared
	EG_FLOW_FORGOTTEN, // besides the outcome: a SYN's flow had a filter entry, dropped
	IN_HIT,
	IN_PASS_NOT_VXLAN,
	IN_PASS_NOT_MINE,
	IN_PASS_UNSUPPORTED,
	IN_PASS_CONTROL,
	IN_PASS_TTL,
	IN_PASS_REVERSE,
	IN_MISS_FILTER,
	IN_MISS_INGRESS,
	IN_ERR_DECAP,
	IN_FLOW_FORGOTTEN, // besides the outcome: a SYN's flow had a filter entry, dropped
	IN_HIT_SHAPED, // besides the hit: delivered through the host veth's qdisc (rate limit)
	EI_LEARN,
	EI_PAUSED,
	EI_CLEARED,
	EI_PASS,
	EI_PASS_NOT_OVERLAY,
	II_LEARN,
	II_PAUSED,
	II_CLEARED,
	II_PASS,
	NR_REASONS,
};
