// Part of sockets.c (one bpf2go unit): the maps and the helpers every program uses.
#pragma once

struct {
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC | BPF_F_CLONE);
	__type(key, int);
	__type(value, struct sks_info);
} sks_storage SEC(".maps");

struct {
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64); // cgroup id
	__type(value, struct sks_container);
} sks_containers SEC(".maps");

// Which of the options in optset.h each socket of a replaced container had
// set (bit i: the i-th), for the seccomp agent's swap.
struct {
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u32);
} sks_optset SEC(".maps");

// optset_bit is (level, name)'s bit in sks_optset.
static __always_inline int optset_bit(int level, int name)
{
	int i = 0;
#define OPTSET_BIT(l, n, len)                \
	if (level == (l) && name == (n))      \
		return i;                     \
	i++;
	SKS_OPTSET(OPTSET_BIT)
#undef OPTSET_BIT
	return SKS_OPTSET_OTHER;
}

// Published replaced listeners of the cluster, by overlay address and
// port: the value is the listener's host.
struct {
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct sks_key);
	__type(value, __be32);
} sks_routes SEC(".maps");

// The policy, in the one slot of a map of maps: the agent writes each
// version into a new inner map and swaps it in, so connect4 reads one
// version whole, never one half-written. (The pointer, declared first,
// makes the compiler describe struct sks_rules in full: an inner map's
// value type is otherwise only forward-declared.)
const struct sks_rules *unused_sks_rules __attribute__((unused));

struct sks_rules_map {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct sks_rules);
};

struct {
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, 1);
	__type(key, __u32);
	__array(values, struct sks_rules_map);
} sks_policy SEC(".maps");

struct {
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 16384);
	__type(key, struct sks_key);
	__type(value, __u64);
} sks_listen SEC(".maps");

struct {
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	// Per-CPU LRU lists: recording a SYN takes no global LRU lock.
	__uint(map_flags, BPF_F_NO_COMMON_LRU);
	__uint(max_entries, 65536);
	__type(key, struct sks_tuple);
	__type(value, struct sks_pending);
} sks_syns SEC(".maps");

struct {
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 4096);
	__type(key, struct sks_subnet);
	__type(value, __be32); // the host owning the subnet
} sks_subnets SEC(".maps");

// Overlay ports bound by a container's socket that does not listen yet,
// with the socket's cookie: a second bind of the port fails (EADDRINUSE) as
// it would in the container's own namespace, where sks_listen would only
// catch it once the first listens. The entry goes when the socket listens
// (sks_listen holds the port from then on) or is closed (sock_release).
struct {
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 16384);
	__type(key, struct sks_key);
	__type(value, __u64);
} sks_bound SEC(".maps");

// Container addresses that have had a replaced listener: only they can
// have connections on the host stack (accepted from one). sockops adds an
// address when a listener is published; the agent removes it with the
// container.
struct {
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __be32);
	__type(value, __u8);
} sks_served SEC(".maps");

// Ports each container's host sockets hold, by its address: bound (in
// sks_bound) or listening (in sks_listen, or bound to lo when it could not
// be published). A socket is counted once, from its bind (or its listen,
// without a bind) to its release; past cfg_listen_quota the container's
// further binds and listens are refused and the shim gives it container
// sockets (the overlay), so that no container takes its neighbours' share
// of the host-wide maps. The agent removes an address with its container.
struct {
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 4096);
	__type(key, __be32);
	__type(value, __u32);
} sks_held SEC(".maps");

// Set while a steering program looks up a connection: the lookup runs
// sks_lookup too (the kernel's listener path), which then answers "none"
// at once instead of judging a delivery. Per CPU: the lookup runs on the
// program's CPU, with bottom halves off.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} sks_probing SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64); // socket cookie
	__type(value, __u8);
} sks_kill SEC(".maps");

struct {
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 64 * 1024);
} sks_events SEC(".maps");

struct {
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, SKS_REASONS);
	__type(key, enum sks_reason); // names the counters (bpfmap.CounterNames)
	__type(value, __u64);
} sks_stats SEC(".maps");

static __always_inline void count(__u32 reason)
{
	__u64 *n = bpf_map_lookup_elem(&sks_stats, &reason);
	if (n)
		*n += 1;
}

static __always_inline bool in_cluster(__be32 ip) { return (ip & cfg_cluster_mask) == cfg_cluster_net; }

// A container's address on this host: the subnet's first two addresses are
// the host's own (the VXLAN device's and the bridge's).
static __always_inline bool local_container(__be32 ip)
{
	return (ip & cfg_local_mask) == cfg_local_net && bpf_ntohl(ip & ~cfg_local_mask) > 1;
}

// The socket's own namespace (not the caller's) decides: container-netns
// sockets of the same cgroup are the overlay's and are left alone.
static __always_inline bool host_socket(void *ctx) { return bpf_get_netns_cookie(ctx) == cfg_host_netns; }

static __always_inline struct sks_info *info_of(struct bpf_sock *sk)
{
	if (!sk)
		return NULL;
	return bpf_sk_storage_get(&sks_storage, sk, 0, 0);
}
