// Types shared by steering.c and the Go loader (bpf2go -type).
#pragma once

#define STX_MAX_CPUS 64

// What the agent configures: the CPUs that take part, in the order of the
// RPS map the kernel builds from an rps_cpus mask (ascending), and the
// two-choice rule's threshold.
struct stx_cfg {
	__u32 n;           // CPUs taking part; 0: steering off (nothing written)
	__u32 threshold;   // load (percent) at which a stage's first choice is avoided
	__u64 stale_ns;    // loads older than this are not believed
	__u32 heavy_bytes; // a flow with this many bytes in a window is steered (0: every flow)
	__u32 window_ns;   // the window
	__u32 udp_batch;   // a heavy UDP flow's next stage moves on every this many packets (0: never)
	__u32 seed;        // mixed into every flow's hash: senders cannot aim flows at a CPU or a map slot
	__u32 cpus[STX_MAX_CPUS];
};

// A flow's traffic at one stage's device: bytes in the current window,
// and whether it is heavy (steered).
struct stx_flow {
	__u64 start;
	__u32 bytes;
	__u32 heavy;
	__u32 pkts;   // all of the flow's packets at the device
	__u32 idx;    // the CPU picked for its next stage in this window (STX_MAX_CPUS: none yet)
	__u32 reason; // and why
	__u32 pad;
};

// Each CPU's load, sampled by the agent (percent, smoothed), and when.
struct stx_load {
	__u64 stamp_ns; // CLOCK_MONOTONIC (bpf_ktime_get_ns)
	__u32 pct[STX_MAX_CPUS];
};

// The stages of the overlay's receive path, each counted on the CPU that
// runs it (docs/steering.md).
enum stx_stage {
	STX_STAGE_UNDERLAY = 0,  // underlay: IP, UDP, VXLAN decapsulation
	STX_STAGE_VXLAN = 1,     // skiff.vxlan: forwarding, bridge, host veth
	STX_STAGE_CONTAINER = 2, // container eth0: IP, TCP/UDP, socket
	STX_NSTAGES = 3,
};

// Why a packet went where it did (per-CPU counters).
enum stx_reason {
	STX_FIRST = 0,        // the flow's first choice for the stage
	STX_SECOND = 1,       // the first choice's CPU was loaded: the second
	STX_SELF_AVOIDED = 2, // the first choice was this CPU: the next one
	STX_STALE_LOAD = 3,   // loads too old to judge: first choice
	STX_NOT_VXLAN = 4,    // underlay traffic that is not the overlay's
	STX_NOT_IPV4 = 5,     // (inner) frame not IPv4: untouched
	STX_MALFORMED = 6,    // truncated or bad headers: untouched
	STX_FRAGMENT = 7,     // IPv4 fragment: steered by addresses and protocol
	STX_LIGHT = 8,        // a light flow: its next stage stays on this CPU
	STX_SPLIT = 9,        // a heavy UDP flow's packets: its batch's CPU (mFlow)
	STX_NREASONS = 10,
};

// The last decision (tests: cfg_record), as BPF_PROG_RUN cannot return
// skb->hash.
struct stx_last {
	__u32 hash;
	__u32 idx;
	__u32 cpu;
	__u32 reason;
	__u32 flow;
	__u32 pad;
};
