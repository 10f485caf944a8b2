// skiff's policy judged in eBPF: the maps policymap/compile.go fills from
// the rule set and the verdict a program reads for a flow's first packet,
// with the same answer as the overlay's SKIFF-POLICY chain (docs/cache.md,
// "Policy in eBPF").
//
// For each local container and direction the rules that can apply to it
// (egress: those whose source covers it; ingress: whose destination does)
// are cut by the other side's prefixes: an address's longest matching
// prefix names a node, and every address with that node is matched by the
// same rules, in the same order. A node's verdicts are a small table by
// (protocol, port): the ports its rules name, each protocol's "any other
// port", and "any other protocol". A packet costs one LPM lookup and at
// most three hash lookups, however many rules there are.
#pragma once

// The maps' bound: an entry per local container and prefix its rules
// name (the 10 000 rules of skiff bench --scale needed 70 000).
// They take memory as they fill (no preallocation): about 100 bytes an
// entry.
#define SKP_MAX_ENTRIES (1 << 20)

#define SKP_UNKNOWN 0 // the container is not compiled: the overlay judges
#define SKP_ALLOW 1
#define SKP_DENY 2

// The local container's address, then the other end's: prefixlen counts
// the container's 32 bits too.
struct skp_lpm_key {
	__u32 prefixlen;
	__u32 local; // network order
	__u32 addr;  // network order
};

// A node's verdict for a protocol (0: any protocol no rule names) and a
// destination port (host order; 0: any port no rule names).
struct skp_vkey {
	__u32 node;
	__u16 port;
	__u8 proto;
	__u8 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, SKP_MAX_ENTRIES);
	__type(key, struct skp_lpm_key);
	__type(value, __u32);
} skp_egress SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, SKP_MAX_ENTRIES);
	__type(key, struct skp_lpm_key);
	__type(value, __u32);
} skp_ingress SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, SKP_MAX_ENTRIES);
	__type(key, struct skp_vkey);
	__type(value, __u8);
} skp_verdicts SEC(".maps");

// skp_verdict judges a flow's first packet for the local container local
// (egress: its source; ingress: its destination) and the other end other,
// by protocol and destination port (host order; 0 for protocols without
// ports). lpm is &skp_egress or &skp_ingress.
static __always_inline int skp_verdict(void *lpm, __u32 local, __u32 other, __u8 proto, __u16 port)
{
	struct skp_lpm_key k = {.prefixlen = 64, .local = local, .addr = other};
	__u32 *node = bpf_map_lookup_elem(lpm, &k);
	if (!node)
		return SKP_UNKNOWN;
	struct skp_vkey v = {.node = *node, .port = port, .proto = proto};
	__u8 *a;
	if (port && (a = bpf_map_lookup_elem(&skp_verdicts, &v)))
		return *a;
	v.port = 0;
	if ((a = bpf_map_lookup_elem(&skp_verdicts, &v)))
		return *a;
	v.proto = 0;
	if ((a = bpf_map_lookup_elem(&skp_verdicts, &v)))
		return *a;
	// Every node has its "any protocol" verdict; none: mid-update.
	return SKP_UNKNOWN;
}
