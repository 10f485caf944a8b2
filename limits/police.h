// Types shared by police.c and the Go loader (bpf2go -type).
#pragma once

// A container's egress policer, by its host veth's index: a token bucket
// of burst bytes refilled at rate bytes/s (tokens and last are the
// program's).
struct skr_policer {
	struct bpf_spin_lock lock;
	__u32 pad;
	__u64 rate;
	__u64 burst;
	__u64 tokens;
	__u64 last; // ns, monotonic; 0: full
};

enum skr_counter {
	SKR_PASSED = 0,
	SKR_DROPPED = 1, // over the container's limit: sent past its own qdisc
	SKR_NCOUNTERS = 2,
};
