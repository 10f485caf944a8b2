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
	__u8 ready;  // MACs known (set by the agent at ADD, or learned)
	__u8 shaped; // an ingress rate limit: deliver through the veth's qdisc
	__u8 pad[2];
	__s32 netns_id; // the container's namespace id in the host's (-1: none)
};

// A connection the fast path owns from its first SYN (flows.h).
struct flow_state {
	__u64 seen;   // bpf_ktime_get_coarse_ns() of a recent segment
	__u8 state;   // enum flow_st
	__u8 fin;     // FINs seen: 1 from the local container, 2 to it
	__u8 outbound; // the local container opened it
	__u8 pad[5];
};

struct control {
	__u32 paused; // learning paused (delete-and-reinitialize in progress)
	__u32 policy; // policymap.h's maps hold the current policy: SYNs may open connections
	__u32 vxlan;  // the overlay's VXLAN device (ifindex): restored packets the fast path cannot carry go there
	__u32 pad;
};

// The rewriting tunnel (tunnel.h). A pair is a local container and a
// remote one; each host gives the other a key for the pair's packets to it.
struct rw_pair_key {
	__be32 local;
	__be32 remote;
};

struct rw_pair {
	__u64 heard;  // bpf_ktime_get_coarse_ns() of a recent packet of the pair from the peer
	__u16 send;   // the peer's key for this host's packets of the pair (0: none)
	__u16 recv;   // this host's key for the peer's packets of the pair (0: none)
	__u8 pending; // recv not yet acknowledged: advertised on the pair's VXLAN packets
	__u8 pad[3];
};

struct rw_key_key {
	__be32 peer; // the host that sends with the key
	__u16 key;
	__u16 pad;
};

struct rw_key {
	__u64 seen;    // allocation, or (dead) the last packet that carried it
	__be32 remote; // the pair the key restores to
	__be32 local;
	__u8 dead;     // no pair: packets with it are dropped until the agent frees it
	__u8 pad[7];
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
	EG_TABLE_HIT,      // besides the hit: it went by the connection table
	EG_TABLE_OPEN,     // besides the hit: a SYN opened a connection
	EG_NEW_DENIED,     // a SYN the policy denies: the overlay rejects it
	EG_NEW_UNJUDGED,   // a SYN with no verdict (policy not compiled or being changed)
	EG_NO_PATH,        // an allowed SYN or a table connection's segment whose path (either way) is unknown
	EG_TABLE_FULL,     // a SYN allowed, but the table is full
	EG_NEW_TRACKED,    // a UDP flow's first packet conntrack already tracks (begun on the overlay, or NAT's)
	LO_TABLE_HIT, // a segment between two containers of this host, by the table
	LO_TABLE_OPEN, // besides the hit: a SYN opened a connection
	LO_NEW_DENIED,
	LO_NEW_UNJUDGED,
	LO_NO_PATH,
	LO_NEW_NO_LISTENER,
	LO_TABLE_FULL,
	LO_NEW_TRACKED,
	LO_PASS,      // TCP to this host's subnet the table does not carry: the bridge's
	LO_ERR,
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
	IN_TABLE_HIT,      // besides the hit: it went by the connection table
	IN_TABLE_OPEN,
	IN_NEW_DENIED,
	IN_NEW_UNJUDGED,
	IN_NO_PATH,
	IN_NEW_NO_LISTENER, // an allowed SYN to no socket of the container's namespace
	IN_TABLE_FULL,
	IN_NEW_TRACKED,
	IN_RESTORED,       // besides the outcome: a rewritten packet, restored
	IN_RW_TO_OVERLAY,  // a restored packet the fast path does not carry: into the VXLAN device
	IN_RW_UNKNOWN_KEY, // a peer's rewritten packet with a key this host never gave: dropped
	IN_RW_DEAD_KEY,    // with a key whose pair is gone: dropped
	IN_RW_SPOOFED,     // the key's remote container does not live on the sending host: dropped
	EG_REWRITTEN,      // besides the hit: sent rewritten, not in VXLAN
	EG_RW_KEYS_FULL,   // no key left for a pair (the peer's packets of it stay VXLAN)
	EG_TOO_BIG,        // a packet that cannot go rewritten and does not fit VXLAN: the overlay's
	EI_SCRUBBED,       // a DF packet to a peer that is not rewritten: ID bit 15 set
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
