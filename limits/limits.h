// Types shared by limits.c and the Go loader (bpf2go -type).
#pragma once

enum skl_dir {
	SKL_EGRESS = 0,
	SKL_INGRESS = 1,
};

// A container's limit as the token buckets apply it: bytes per second and
// bytes, per direction (skl_dir); a zero rate is no limit that way.
// pace is the egress rate in bytes/s its host TCP sockets are paced at
// (SO_MAX_PACING_RATE; ~0U: not paced). Packets for its host sockets are
// shaped in the HTB class with minor class of the IFB device (0: not).
// tos and priority are its QoS class's, for its host sockets (0: normal).
struct skl_limit {
	__u64 rate[2];
	__u64 burst[2];
	__u32 pace;
	__u32 class;
	__u32 tos;
	__u32 priority;
};

// A container's buckets: tokens in bytes, refilled at the rate since last.
struct skl_bucket {
	struct bpf_spin_lock lock;
	__u32 pad;
	__u64 tokens[2];
	__u64 last[2];
};

enum skl_counter {
	SKL_PASSED = 0,
	SKL_EGRESS_HELD = 1,    // TCP told to wait (drop with congestion notice: kept in its queue)
	SKL_EGRESS_DROPPED = 2, // other egress over the limit
	SKL_INGRESS_DROPPED = 3,
	SKL_PACED = 4,          // host sockets given a pacing rate
	SKL_SHAPED = 5,         // packets for host sockets sent through the IFB's HTB
	SKL_CLASSED = 6,        // host sockets given a QoS class's TOS and priority
	SKL_NCOUNTERS = 7,
};
