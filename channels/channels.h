// Types shared by channels.c and the Go loader (bpf2go -type).
#pragma once

// A TCP socket in skch_socks, by its own 4-tuple (addresses in network
// order, ports in host order), its kind: a container-namespace socket (0)
// or a host socket of the sockets layer (1), and its side: the one that
// connected (1) or accepted (0). A socket's peer is of its own kind and of
// the other side: the kinds' addresses cannot meet, and the agent finds
// every channelled connection's client in the map itself (no side table
// that could forget one).
struct skch_key {
	__u32 sip;
	__u32 dip;
	__u32 sport;
	__u32 dport;
	__u32 host;
	__u32 client;
};

// Which way one direction of a connection goes: decided at its first
// send, and it can only fall back (channel to TCP), never come back: the
// receiver reads what the channel queued before what TCP brings, so a
// direction that switched twice could reorder bytes.
enum skch_state {
	SKCH_UNDECIDED = 0,
	SKCH_CHANNEL = 1,
	SKCH_TCP = 2,
};

// A socket's channel state (socket storage): its sending direction, and,
// for a host socket, the container it serves (a container socket's own
// address says that).
struct skch_sock {
	enum skch_state state;
	__u32 host;
	__u32 client;
	__u32 ip; // the container's address, network order (host sockets)
};

enum skch_counter {
	SKCH_ADDED = 0,        // sockets joined to the channel map
	SKCH_ADD_FAILED = 1,   // the map full, or the 4-tuple already there
	SKCH_REDIRECTED = 2,   // messages sent socket to socket
	SKCH_TCP_NO_PEER = 3,  // a direction on TCP: no peer in the map at its first send
	SKCH_FELL_BACK = 4,    // a channelled direction back on TCP: the peer left, or an end got a rate limit
	SKCH_DESTROYED = 5,    // channelled sockets ended: the policy denies their flow
	SKCH_SOCKOPT = 6,      // sockets sent to TCP for an option a channel cannot honour
	SKCH_REMOTE = 7,       // established sockets left out: the peer is not a local container
	SKCH_OPTED_OUT = 8,    // established sockets left out: they set SKIFF_SO_NOCHANNEL (the seccomp agent's)
	SKCH_NCOUNTERS = 9,
};
