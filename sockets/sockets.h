// Types shared by sockets.c and the Go loader (bpf2go -type).
#pragma once

// The SYN option that carries overlay addresses (RFC 6994 experimental
// option, kind 253, ExID 0x5352 "SR"): 14 bytes, padded to 16 by the stack.
// Linux's own SYN options take 20 of the 40 bytes, so this fits beside them.
#define SKS_OPT_KIND 253
#define SKS_OPT_LEN 14
#define SKS_OPT_MAGIC 0x5352

struct sks_opt {
	__u8 kind;
	__u8 len;
	__be16 magic;
	__be32 dst_ip;   // overlay destination
	__be16 dst_port;
	__be32 src_ip;   // overlay source
} __attribute__((packed));

// An overlay endpoint: a listener's overlay address and port.
struct sks_key {
	__be32 ip;
	__be16 port;
	__u16 pad;
};

// One policy rule as connect4 judges it: rules that cannot match TCP are
// left out by the agent. Prefixes are masked; a zero mask matches anything,
// and so does a zero port_mask.
struct sks_rule {
	__be32 src;
	__be32 src_mask;
	__be32 dst;
	__be32 dst_mask;
	__be16 port;
	__u16 port_mask;
	__u32 allow;
};

#define SKS_MAX_RULES 1024

// The policy of fast-path connections, in evaluation order: the first rule
// that matches decides, and a connection no rule matches is allowed. With
// more rules than fit (overflow), the fast path carries nothing and the
// overlay's policy judges every connection.
struct sks_rules {
	__u32 n;
	__u32 overflow;
	struct sks_rule rules[SKS_MAX_RULES];
};

// Host-side 4-tuple of a SYN, as seen on the server host.
struct sks_tuple {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
};

// What the server host learned from a SYN's option.
struct sks_pending {
	__be32 dst_ip;
	__be32 src_ip;
	__be16 dst_port;
	__u16 pad;
};

enum sks_role {
	SKS_FRESH = 1,  // a host socket handed to a container, not used yet
	SKS_CLIENT = 2, // connected through the fast path
	SKS_LISTEN = 3, // bound to an overlay address (really on loopback)
	SKS_CHILD = 4,  // accepted from a replaced listener
	SKS_EXPOSED = 5, // listening on a host address (listen without bind), or accepted there: ended
};

// Per-socket overlay identity (socket storage, cloned into accepted children).
struct sks_info {
	__be32 local_ip;  // the container's overlay address
	__be32 peer_ip;   // what getpeername shows
	__be32 steer_ip;  // overlay destination written into the SYN option
	__be16 local_port; // overlay port of a listener (0: the real port)
	__be16 peer_port;
	__u8 role;
	__u8 held; // counted in sks_held (a bound port or a listener of its container)
	__u8 pad[2];
};

// A container the layer serves, by cgroup id.
struct sks_container {
	__be32 ip;
	__u32 flags;
};

// Longest-prefix key of host subnets (anti-spoofing).
struct sks_subnet {
	__u32 prefixlen;
	__be32 ip;
};

enum sks_event_kind {
	SKS_EV_LISTEN = 1,
	SKS_EV_CLOSE = 2,
	SKS_EV_EXPOSED = 3, // a listener on a host address: to be ended
};

// Ring-buffer event: a replaced listener appeared or went away.
struct sks_event {
	__u32 kind;
	__be32 ip;
	__be16 port;
	__u16 pad;
};

// One replaced socket, as the socket iterator reports it.
struct sks_sock {
	__u64 cookie;
	__be32 local_ip;
	__be32 peer_ip;
	__be16 local_port; // host order
	__be16 peer_port;  // host order
	__u8 role;
	__u8 state;
	__u16 pad;
};

// Counters (per-CPU array). Keep Reasons in sockets.go in this order.
enum sks_reason {
	SKS_STAMPED,          // host socket created in a container's cgroup
	SKS_CONNECT_FAST,     // connect rewritten to the listener's host
	SKS_CONNECT_REFUSED,  // connect to a destination the fast path may not carry
	SKS_BIND_REWRITTEN,   // bind moved to loopback
	SKS_BIND_REFUSED,     // bind to a non-overlay address
	SKS_BIND_INUSE,       // overlay address and port already taken
	SKS_SOCKOPT_REFUSED,  // secure mode refused a socket option
	SKS_OPT_WRITTEN,      // SYN option written
	SKS_LISTENER_ADDED,   // listener published in the socket map
	SKS_LISTENER_FAILED,  // could not be inserted
	SKS_LISTENER_EXPOSED, // listen() without bind, on a host address
	SKS_SYN_RECORDED,     // option SYN recorded on the server host
	SKS_SYN_SPOOFED,      // option claims a source not on the sending host
	SKS_SYN_MALFORMED,    // option present but unusable
	SKS_ASSIGNED,         // sk_lookup steered a SYN to a replaced listener
	SKS_NO_LISTENER,      // recorded SYN without a listener (RST)
	SKS_OVERLAY_ASSIGNED, // overlay-path SYN steered to a replaced listener
	SKS_OVERLAY_STEERED,  // overlay packet sent to the host stack
	SKS_ACCEPTED,         // child learned its peer's overlay address
	SKS_ACCEPTED_UNKNOWN, // child whose peer is unknown (shows 0.0.0.0)
	SKS_DESTROYED,        // connection ended by a policy change
	SKS_TOS_CLEARED,      // packet for a container with the route's TOS, not steered
	SKS_OVERLAY_REFUSED,  // connection (or datagram) to a container address without its listener
	SKS_SYNCOOKIE_STEERED, // overlay ACK completing a replaced listener's syncookie
	SKS_CONNECT_DENIED,   // connect the policy denies (or no policy written): the overlay judges it
	SKS_SYN_FORGED,       // a container's own SYN carrying the option: dropped
	SKS_EVENT_LOST,       // the ring buffer was full: the agent sweeps for what it missed
	SKS_TCP_FRAGMENT,     // a TCP fragment that could hide an option SYN: dropped
	SKS_TCP_MALFORMED,    // a container's TCP segment with a truncated or bad header: dropped
	SKS_SYN_DENIED,       // recorded SYN the server host's policy denies (RST)
	SKS_ORIGDST_SHOWN,    // SO_ORIGINAL_DST answered with the overlay address
	SKS_SAME_HOST_UNRECORDED, // same-host segment without its record: refused, never a host socket's
	SKS_LISTEN_QUOTA,     // bind or listen past the container's quota: a container socket instead
	SKS_REASONS,
};
