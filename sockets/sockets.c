//go:build ignore

// skiff's sockets layer: a container's TCP sockets are host sockets (Slim,
// NSDI '19; SlimFast), so its connections cross the network stack once, with
// no encapsulation, no veth and no user-space hop on connect or accept.
//
// The programs, by where they sit:
//   sock_create   container cgroup: stamps host-namespace TCP sockets the
//                 container's broker creates with the container's overlay
//                 address (the socket's cgroup, fixed at creation, selects
//                 every hook below — not the cgroup of whoever calls).
//   connect4      container cgroup: an overlay destination whose listener is
//                 replaced and that the policy (first matching rule) allows
//                 becomes its host's underlay address (same port); anything
//                 else is refused (EPERM) and the shim falls back to a
//                 container socket.
//   bind4         container cgroup: binds move to 127.0.0.1:<ephemeral>, so
//                 a replaced listener is unreachable without the SYN option;
//                 a second listener on the same overlay port gets EADDRINUSE.
//   getsockname4/getpeername4: show overlay addresses, never host ones.
//   setsockopt    secure mode: priority, TOS, mark, device binding, saved
//                 SYNs, repair, forced buffers and the received-packet
//                 address options are refused on host sockets; records
//                 which options of optset.h a socket set.
//   getsockopt    SO_ORIGINAL_DST shows overlay addresses, never host ones;
//                 answers which options a socket had set (optset.h).
//   sockops       writes the overlay addresses into the SYN (option kind 253),
//                 publishes listeners in a socket map, learns an accepted
//                 connection's overlay peer.
//   from_underlay TCX ingress of the underlay device: records a whole
//                 (unfragmented) SYN's 4-tuple with the option's overlay
//                 addresses; drops SYNs whose claimed source does not live
//                 on the sending host, and SYNs in fragments.
//   lookup        sk_lookup in the host namespace: steers recorded SYNs — and
//                 overlay-path SYNs routed locally — to the replaced listener.
//                 It runs inside the listener lookup, so SYN retransmits,
//                 TIME_WAIT recycling and syncookies (the entry stays until
//                 the connection is established) all work. No other socket
//                 of the host takes a connection to a container's address.
//                 A recorded SYN is judged by this host's policy too.
//   from_overlay, from_container, from_host: overlay packets for replaced
//                 listeners go to the host stack (by their TOS, which a local
//                 route of the host matches; see route_container_packet).
//                 from_container also drops a container's TCP fragments,
//                 malformed segments and option SYNs (forged).
//   dump/destroy  iter/tcp: list replaced sockets; end the ones the agent
//                 marks (policy changes) with bpf_sock_destroy.

#include <stdbool.h>
#include <stddef.h>
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "sockets.h"
#include "optset.h"

char __license[] SEC("license") = "GPL";

#define AF_INET 2
#define SOCK_STREAM 1
#define SOL_SOCKET 1
#define SO_BINDTODEVICE 25
#define SO_PRIORITY 12
#define SO_MARK 36
#define SO_BINDTOIFINDEX 62
#define SO_SNDBUFFORCE 32
#define SO_RCVBUFFORCE 33
#define SO_REUSEPORT 15
#define SOL_IP 0
#define IP_TOS 1
#define IP_OPTIONS 4
#define SO_ORIGINAL_DST 80
#define SOL_TCP 6
#define TCP_SAVE_SYN 27
#define TCPHDR_SYN 0x02
#define TCPHDR_ACK 0x10
#define TCP_LISTEN 10
#define TCP_CLOSE 7
#define EADDRINUSE 98
#define EEXIST 17
#define LOOPBACK_NET 0x7f000000 // 127.0.0.0/8, host order
#define LOOPBACK_IP 0x7f000001
#define LOOPBACK_IFINDEX 1 // lo, in every namespace

// Configuration, set by the agent before load.
volatile const __u64 cfg_host_netns;   // netns cookie of the host namespace
volatile const __be32 cfg_cluster_net; // cluster CIDR
volatile const __be32 cfg_cluster_mask;
volatile const __be32 cfg_local_net;   // this host's subnet
volatile const __be32 cfg_local_mask;
volatile const __u32 cfg_secure;       // refuse what is not the fast path
volatile const __u32 cfg_mark;         // overlay packets the host stack takes (policy)
volatile const __u8 cfg_tos;           // routes them there (TOS bits of a local route)
volatile const __be32 cfg_same_host;    // both ends of a same-host fast connection (on lo)
volatile const __u32 cfg_listen_quota;  // ports a container's host sockets may hold (bound or listening)

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

SEC("cgroup/sock_create")
int sks_sock_create(struct bpf_sock *sk)
{
	if (sk->family != AF_INET || sk->type != SOCK_STREAM || !host_socket(sk))
		return 1;
	__u64 cg = bpf_get_current_cgroup_id();
	struct sks_container *c = bpf_map_lookup_elem(&sks_containers, &cg);
	if (!c)
		return 1;
	struct sks_info *si = bpf_sk_storage_get(&sks_storage, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!si)
		return 0; // a replaced socket without identity must not exist
	si->local_ip = c->ip;
	si->role = SKS_FRESH;
	count(SKS_STAMPED);
	return 1;
}

// Host sockets of a container cgroup that carry no overlay identity (none
// should exist) get nothing in secure mode.
static __always_inline int unstamped(void) { return cfg_secure ? 0 : 1; }

// The policy's verdict on a fast-path connection from src to dst:port.
// Without a policy (none written yet, or more rules than fit) nothing is
// allowed: the shim falls back and the overlay judges.
static __always_inline bool allowed(__be32 src, __be32 dst, __be16 port)
{
	__u32 zero = 0;
	void *inner = bpf_map_lookup_elem(&sks_policy, &zero);
	if (!inner)
		return false;
	struct sks_rules *p = bpf_map_lookup_elem(inner, &zero);
	if (!p || p->overflow)
		return false;
	__u32 n = p->n;
	for (__u32 i = 0; i < SKS_MAX_RULES && i < n; i++) {
		struct sks_rule *r = &p->rules[i];
		__u32 miss = ((src & r->src_mask) ^ r->src) | ((dst & r->dst_mask) ^ r->dst) |
			     ((port ^ r->port) & r->port_mask);
		if (!miss)
			return r->allow;
	}
	return true;
}

// unreserve gives up the bind-time hold of k, if the socket with cookie has it.
static __always_inline void unreserve(struct sks_key *k, __u64 cookie)
{
	__u64 *holder = bpf_map_lookup_elem(&sks_bound, k);
	if (holder && *holder == cookie)
		bpf_map_delete_elem(&sks_bound, k);
}

// charge counts the socket against its container's quota (once): false
// past the quota, or when sks_held is full.
static __always_inline bool charge(struct sks_info *si)
{
	if (si->held)
		return true;
	__u32 *n = bpf_map_lookup_elem(&sks_held, &si->local_ip);
	if (!n) {
		__u32 zero = 0;
		bpf_map_update_elem(&sks_held, &si->local_ip, &zero, BPF_NOEXIST);
		n = bpf_map_lookup_elem(&sks_held, &si->local_ip);
		if (!n)
			return false;
	}
	// Read, then added to: binds racing on other CPUs can pass the
	// quota by one each (the programs are built for BPF v1, which has
	// no fetching atomics).
	if (*n >= cfg_listen_quota)
		return false;
	__sync_fetch_and_add(n, 1);
	si->held = 1;
	return true;
}

// uncharge gives the socket's count back.
static __always_inline void uncharge(struct sks_info *si)
{
	if (!si->held)
		return;
	si->held = 0;
	__u32 *n = bpf_map_lookup_elem(&sks_held, &si->local_ip);
	if (n && *n > 0) // 0: the address was forgotten and given again
		__sync_fetch_and_add(n, -1);
}

// A bound socket closed before it listened: its port is free again. Every
// connection's sockets come here too, still connected: they return before
// the storage lookup. (A listener holds a port only if it could not be
// published.)
SEC("cgroup/sock_release")
int sks_sock_release(struct bpf_sock *sk)
{
	if (sk->family != AF_INET || sk->type != SOCK_STREAM || (sk->state != TCP_CLOSE && sk->state != TCP_LISTEN))
		return 1;
	struct sks_info *si = info_of(sk);
	if (!si || si->role != SKS_LISTEN || !si->local_port)
		return 1;
	struct sks_key k = {.ip = si->local_ip, .port = si->local_port};
	unreserve(&k, bpf_get_socket_cookie(sk));
	uncharge(si);
	return 1;
}

SEC("cgroup/connect4")
int sks_connect4(struct bpf_sock_addr *ctx)
{
	if (!host_socket(ctx))
		return 1;
	struct sks_info *si = info_of(ctx->sk);
	if (!si)
		return unstamped();
	if (si->role != SKS_FRESH || ctx->type != SOCK_STREAM) {
		count(SKS_CONNECT_REFUSED);
		return 0;
	}
	__be32 dst = ctx->user_ip4, steer = dst;
	// The container's own loopback reaches its own replaced listeners.
	if ((bpf_ntohl(dst) & 0xff000000) == LOOPBACK_NET)
		steer = si->local_ip;
	struct sks_key k = {.ip = steer, .port = (__u16)ctx->user_port};
	__be32 *host = bpf_map_lookup_elem(&sks_routes, &k);
	if (!host) {
		count(SKS_CONNECT_REFUSED);
		// An overlay or loopback destination without a replaced listener
		// has the container's own path (the overlay, its own loopback),
		// never the host's: an overlay address may be one of the host's
		// own (its gateway), where the guard does not see a host socket.
		if (cfg_secure || in_cluster(dst) || steer != dst)
			return 0;
		return 1;
	}
	if (!allowed(si->local_ip, steer, k.port)) {
		count(SKS_CONNECT_DENIED);
		return 0;
	}
	__be32 to = *host;
	if (local_container(steer)) {
		// Same host: from and to an address of lo that no host socket
		// may take (sks_lookup), so that a SYN whose record is gone is
		// refused, never delivered to a host listener on the port.
		struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = cfg_same_host};
		if (bpf_bind(ctx, (struct sockaddr *)&sa, sizeof(sa))) {
			count(SKS_CONNECT_REFUSED);
			return 0;
		}
		to = cfg_same_host;
	}
	si->peer_ip = dst;
	si->peer_port = k.port;
	si->steer_ip = steer;
	si->role = SKS_CLIENT;
	ctx->user_ip4 = to;
	count(SKS_CONNECT_FAST);
	return 1;
}

SEC("cgroup/bind4")
int sks_bind4(struct bpf_sock_addr *ctx)
{
	if (!host_socket(ctx))
		return 1;
	struct sks_info *si = info_of(ctx->sk);
	if (!si)
		return unstamped();
	if (si->role != SKS_FRESH || ctx->type != SOCK_STREAM ||
	    (ctx->user_ip4 != 0 && ctx->user_ip4 != si->local_ip)) {
		count(SKS_BIND_REFUSED);
		return 0;
	}
	// Listeners sharing a port (SO_REUSEPORT) cannot share the one entry
	// of sks_listen: refused (EPERM), so the shim gives the app a
	// container socket, where the kernel shares the port.
	int reuse = 0;
	if (bpf_getsockopt(ctx, SOL_SOCKET, SO_REUSEPORT, &reuse, sizeof(reuse)) == 0 && reuse) {
		count(SKS_BIND_REFUSED);
		return 0;
	}
	__be16 port = (__u16)ctx->user_port;
	if (port) {
		struct sks_key k = {.ip = si->local_ip, .port = port};
		struct bpf_sock *other = bpf_map_lookup_elem(&sks_listen, &k);
		if (other) {
			bpf_sk_release(other);
			bpf_set_retval(-EADDRINUSE);
			count(SKS_BIND_INUSE);
			return 0;
		}
		__u64 cookie = bpf_get_socket_cookie(ctx);
		__u64 *holder = bpf_map_lookup_elem(&sks_bound, &k);
		if (!holder || *holder != cookie) {
			// Past the quota (or sks_bound full): EPERM, and the shim
			// gives the app a container socket, where the kernel
			// keeps ports.
			if (!charge(si)) {
				count(SKS_LISTEN_QUOTA);
				return 0;
			}
			long err = bpf_map_update_elem(&sks_bound, &k, &cookie, BPF_NOEXIST);
			if (err) {
				uncharge(si);
				if (err == -EEXIST) {
					bpf_set_retval(-EADDRINUSE);
					count(SKS_BIND_INUSE);
				} else {
					count(SKS_BIND_REFUSED);
				}
				return 0;
			}
		}
	}
	si->local_port = port;
	si->role = SKS_LISTEN;
	ctx->user_ip4 = bpf_htonl(LOOPBACK_IP);
	ctx->user_port = 0;
	count(SKS_BIND_REWRITTEN);
	return 1;
}

SEC("cgroup/getsockname4")
int sks_getsockname4(struct bpf_sock_addr *ctx)
{
	struct sks_info *si = info_of(ctx->sk);
	if (!si || !host_socket(ctx))
		return 1;
	ctx->user_ip4 = si->local_ip;
	if (si->local_port)
		ctx->user_port = si->local_port;
	return 1;
}

SEC("cgroup/getpeername4")
int sks_getpeername4(struct bpf_sock_addr *ctx)
{
	struct sks_info *si = info_of(ctx->sk);
	if (!si || !host_socket(ctx))
		return 1;
	// An unknown peer shows as 0.0.0.0 rather than as a host address.
	ctx->user_ip4 = si->peer_ip;
	if (si->peer_port)
		ctx->user_port = si->peer_port;
	return 1;
}

SEC("cgroup/setsockopt")
int sks_setsockopt(struct bpf_sockopt *ctx)
{
	// Every option the container sets comes here: the cheap test first.
	// optlen 0 passes the caller's own buffer to the kernel, which
	// otherwise copies the value a second time (kmalloc, memcpy, kfree).
	int level = ctx->level, name = ctx->optname;
	// Recorded for the seccomp agent, which copies these to the host
	// socket it swaps in for a container's TCP/IPv4 socket (an option it
	// does not copy makes it keep the container's). Host sockets, which it
	// never swaps, get no storage.
	struct bpf_sock *sk = ctx->sk;
	if (sk && sk->family == AF_INET && sk->type == SOCK_STREAM && !host_socket(ctx)) {
		__u32 *set = bpf_sk_storage_get(&sks_optset, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
		if (set) // two threads setting options of one socket at once may lose a bit
			*set |= 1u << optset_bit(level, name);
	}
	// TCP_REPAIR and the buffer limits' *FORCE variants need CAP_NET_ADMIN
	// in the socket's namespace, the host's: a container granted it for
	// its own namespace (Kubernetes' "NET_ADMIN") would otherwise rewrite
	// a host connection's sequence numbers or pin host memory.
	if (!cfg_secure ||
	    !((level == SOL_SOCKET && (name == SO_PRIORITY || name == SO_MARK || name == SO_BINDTODEVICE ||
				       name == SO_BINDTOIFINDEX || name == SO_RCVBUFFORCE || name == SO_SNDBUFFORCE)) ||
	      // IP_PKTOPTIONS would show a packet's host addresses.
	      (level == SOL_IP && (name == IP_TOS || name == IP_OPTIONS || name == IP_PKTINFO ||
				   name == IP_RECVORIGDSTADDR)) ||
	      (level == SOL_TCP && (name == TCP_SAVE_SYN || name == TCP_REPAIR || name == TCP_REPAIR_QUEUE ||
				    name == TCP_QUEUE_SEQ || name == TCP_REPAIR_OPTIONS || name == TCP_REPAIR_WINDOW))) ||
	    !info_of(ctx->sk) || !host_socket(ctx)) {
		ctx->optlen = 0;
		return 1;
	}
	count(SKS_SOCKOPT_REFUSED);
	return 0;
}

// conntrack's original destination of a host connection is a host address
// (the peer host's underlay or loopback): show the overlay one, as
// getpeername and getsockname do. A client's is its peer's, an accepted
// connection's its own.
SEC("cgroup/getsockopt")
int sks_getsockopt(struct bpf_sockopt *ctx)
{
	// Every option the container reads comes here, SO_ERROR after each
	// non-blocking connect included: the cheap test first. optlen 0 keeps
	// the kernel's answer without copying it back a second time.
	struct sockaddr_in *sin = ctx->optval;
	if (ctx->level == SKS_OPTSET_LEVEL && ctx->optname == SKS_OPTSET_NAME) {
		// the options the socket had set (the seccomp agent asks)
		__u32 *out = ctx->optval;
		if ((void *)(out + 1) > ctx->optval_end)
			goto keep;
		__u32 *set = bpf_sk_storage_get(&sks_optset, ctx->sk, 0, 0);
		*out = set ? *set : 0;
		ctx->optlen = sizeof(*out);
		// two stores: the verifier refuses the one 64-bit store clang
		// would merge them into
		asm volatile("" ::: "memory");
		ctx->retval = 0;
		return 1;
	}
	if (ctx->level != SOL_IP || ctx->optname != SO_ORIGINAL_DST || ctx->retval || (void *)(sin + 1) > ctx->optval_end)
		goto keep;
	struct bpf_sock *sk = ctx->sk;
	struct sks_info *si = info_of(sk);
	if (!si || !host_socket(ctx))
		goto keep;
	if (sin->sin_addr.s_addr == sk->dst_ip4 && sin->sin_port == sk->dst_port) {
		sin->sin_addr.s_addr = si->peer_ip;
		if (si->peer_port)
			sin->sin_port = si->peer_port;
	} else {
		sin->sin_addr.s_addr = si->local_ip;
		sin->sin_port = si->local_port ? si->local_port : bpf_htons(sk->src_port);
	}
	count(SKS_ORIGDST_SHOWN);
	return 1;
keep:
	ctx->optlen = 0;
	return 1;
}

// Keeps the event type in BTF for the Go side.
const struct sks_event *unused_sks_event __attribute__((unused));
const struct sks_sock *unused_sks_sock __attribute__((unused));
const enum sks_role *unused_sks_role __attribute__((unused));
const enum sks_event_kind *unused_sks_event_kind __attribute__((unused));

static __always_inline void notify(__u32 kind, __be32 ip, __be16 port)
{
	struct sks_event *ev = bpf_ringbuf_reserve(&sks_events, sizeof(*ev), 0);
	if (!ev) {
		count(SKS_EVENT_LOST); // the agent's periodic resync catches up
		return;
	}
	ev->kind = kind;
	ev->ip = ip;
	ev->port = port;
	ev->pad = 0;
	bpf_ringbuf_submit(ev, 0);
}

// syn_tuple is a connection's 4-tuple as the server saw its SYN (the key of
// sks_syns), from the client's socket or from the server's.
static __always_inline struct sks_tuple syn_tuple(struct bpf_sock_ops *skops, bool client)
{
	__be16 lport = bpf_htons((__u16)skops->local_port);
	__be16 rport = (__u16)(skops->remote_port >> 16); // be16 in the upper half
	if (client)
		return (struct sks_tuple){.saddr = skops->local_ip4, .daddr = skops->remote_ip4, .sport = lport, .dport = rport};
	return (struct sks_tuple){.saddr = skops->remote_ip4, .daddr = skops->local_ip4, .sport = rport, .dport = lport};
}

static __always_inline void bind_to_lo(struct bpf_sock_ops *skops)
{
	static const char lo[] = "lo";
	bpf_setsockopt(skops, SOL_SOCKET, SO_BINDTODEVICE, (void *)lo, sizeof(lo));
}

SEC("sockops")
int sks_sockops(struct bpf_sock_ops *skops)
{
	// Every TCP socket of the cgroup calls in several times per connection
	// (RTO, window and ECN callbacks too): the ones without work return
	// before the socket-storage lookup.
	switch (skops->op) {
	case BPF_SOCK_OPS_HDR_OPT_LEN_CB:
		if ((skops->skb_tcp_flags & (TCPHDR_SYN | TCPHDR_ACK)) == TCPHDR_SYN)
			bpf_reserve_hdr_opt(skops, SKS_OPT_LEN, 0);
		return 1;
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		// Only SYNs carry the option: stop the per-packet callbacks.
		if (skops->bpf_sock_ops_cb_flags & BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG)
			bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags & ~BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG);
		return 1;
	case BPF_SOCK_OPS_WRITE_HDR_OPT_CB:
		if ((skops->skb_tcp_flags & (TCPHDR_SYN | TCPHDR_ACK)) != TCPHDR_SYN)
			return 1;
		break;
	case BPF_SOCK_OPS_TCP_CONNECT_CB:
	case BPF_SOCK_OPS_TCP_LISTEN_CB:
	case BPF_SOCK_OPS_STATE_CB:
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		break;
	default:
		return 1;
	}
	struct bpf_sock *sk = skops->sk;
	struct sks_info *si = info_of(sk);
	if (!si)
		return 1;
	switch (skops->op) {
	case BPF_SOCK_OPS_TCP_CONNECT_CB: {
		if (si->role != SKS_CLIENT)
			break;
		// To a listener on this host (connect4 bound and sent it to
		// cfg_same_host) the SYN goes through lo, where no recorder
		// runs: the client records it, as the server host's recorder
		// would from the option, which the SYN then need not carry.
		if (skops->remote_ip4 != cfg_same_host) {
			bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG);
			break;
		}
		struct sks_tuple t = syn_tuple(skops, true);
		struct sks_pending p = {.dst_ip = si->steer_ip, .src_ip = si->local_ip, .dst_port = si->peer_port};
		if (bpf_map_update_elem(&sks_syns, &t, &p, BPF_ANY) == 0) {
			count(SKS_SYN_RECORDED);
			// Until the connection is established: a connect that
			// fails (refused, timed out) takes the record with it, so a
			// later plain SYN of the tuple on lo never finds it.
			bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
		}
		break;
	}
	case BPF_SOCK_OPS_WRITE_HDR_OPT_CB: {
		struct sks_opt opt = {
			.kind = SKS_OPT_KIND,
			.len = SKS_OPT_LEN,
			.magic = bpf_htons(SKS_OPT_MAGIC),
			.dst_ip = si->steer_ip,
			.dst_port = si->peer_port,
			.src_ip = si->local_ip,
		};
		if (bpf_store_hdr_opt(skops, &opt, sizeof(opt), 0) == 0)
			count(SKS_OPT_WRITTEN);
		break;
	}
	case BPF_SOCK_OPS_TCP_LISTEN_CB: {
		if (si->role != SKS_LISTEN) {
			// Autobound by listen() without bind (the shim never does
			// that), whatever the socket did before: on a host address.
			// Bound to lo before listen() returns, it takes nothing
			// from the network; the agent ends it at once, and what it
			// accepted (a host process's local connection).
			bind_to_lo(skops);
			si->role = SKS_EXPOSED;
			count(SKS_LISTENER_EXPOSED);
			notify(SKS_EV_EXPOSED, si->local_ip, bpf_htons((__u16)skops->local_port));
			break;
		}
		struct sks_key k = {.ip = si->local_ip, .port = si->local_port};
		if (!k.port)
			k.port = bpf_htons((__u16)skops->local_port);
		if (!charge(si)) {
			// Past the container's quota: unpublished, as below.
			bind_to_lo(skops);
			count(SKS_LISTEN_QUOTA);
			break;
		}
		__u8 yes = 1;
		if (bpf_map_update_elem(&sks_served, &k.ip, &yes, BPF_ANY) != 0 ||
		    bpf_sock_hash_update(skops, &sks_listen, &k, BPF_NOEXIST) != 0) {
			// Unpublished (a map full), nothing reaches it. Bound to lo
			// too, which the shim reads when listen() returns: it gives
			// the app a listener of the container's own instead, which
			// the overlay reaches.
			bind_to_lo(skops);
			count(SKS_LISTENER_FAILED);
			break;
		}
		si->local_port = k.port;
		unreserve(&k, bpf_get_socket_cookie(skops));
		bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
		count(SKS_LISTENER_ADDED);
		notify(SKS_EV_LISTEN, k.ip, k.port);
		break;
	}
	case BPF_SOCK_OPS_STATE_CB:
		if (si->role == SKS_LISTEN && skops->args[0] == TCP_LISTEN) {
			notify(SKS_EV_CLOSE, si->local_ip, si->local_port);
		} else if (si->role == SKS_CLIENT) { // a same-host client (above)
			if (skops->args[1] == TCP_CLOSE) {
				struct sks_tuple t = syn_tuple(skops, true);
				bpf_map_delete_elem(&sks_syns, &t);
			}
			// Established, the server deletes the record when it
			// accepts (a syncookie's ACK still needs it until then).
			bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags & ~BPF_SOCK_OPS_STATE_CB_FLAG);
		}
		break;
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB: {
		// The child inherited the listener's storage (BPF_F_CLONE) and
		// state-callback flag; an exposed listener's child stays exposed.
		bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags & ~BPF_SOCK_OPS_STATE_CB_FLAG);
		if (si->role == SKS_EXPOSED)
			break;
		si->role = SKS_CHILD;
		si->held = 0; // cloned from its listener, which keeps the count
		si->peer_port = 0; // the real port is the peer's
		struct sks_tuple t = syn_tuple(skops, false);
		struct sks_pending *p = bpf_map_lookup_elem(&sks_syns, &t);
		if (p) {
			si->peer_ip = p->src_ip;
			bpf_map_delete_elem(&sks_syns, &t);
			count(SKS_ACCEPTED);
		} else if (in_cluster(skops->remote_ip4)) {
			si->peer_ip = skops->remote_ip4; // came over the overlay
			count(SKS_ACCEPTED);
		} else {
			si->peer_ip = 0;
			count(SKS_ACCEPTED_UNKNOWN);
		}
		break;
	}
	}
	return 1;
}

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
// underlay's TCX hook never takes one.

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

SEC("tc")
int sks_from_underlay(struct __sk_buff *skb)
{
	struct iphdr *ip = ipv4_of(skb);
	if (!ip)
		return TC_ACT_UNSPEC;
	// Straight from the underlay to a container (no overlay): as from a
	// container or the overlay, only steered packets may match the route.
	if (local_container(ip->daddr))
		keep_off_route(ip);
	// Only a whole SYN is recorded: a fragment's bytes after the first
	// are no TCP header, and a first fragment's option is not the SYN's
	// until reassembly.
	if (ip->protocol == IPPROTO_TCP && fragment(ip))
		return underlay_fragment(skb, ip);
	struct tcphdr *th = syn_of(skb, ip);
	if (!th)
		return TC_ACT_UNSPEC;
	struct sks_tuple t = {.saddr = ip->saddr, .daddr = ip->daddr, .sport = th->source, .dport = th->dest};
	struct sks_opt o;
	if (!syn_option(skb, ip, th, &o)) {
		// A plain SYN is the host's: a record of its 4-tuple (a fast-path
		// handshake that failed) must not steer it to a container. Looked
		// up first: a delete takes the bucket's lock even for nothing,
		// and every SYN of the host's own connections comes here.
		if (bpf_map_lookup_elem(&sks_syns, &t))
			bpf_map_delete_elem(&sks_syns, &t);
		return TC_ACT_UNSPEC;
	}
	__be32 src = o.src_ip, dst = o.dst_ip;
	__be16 port = o.dst_port;
	// The option is not authenticated: it may only claim a container of the
	// host the SYN comes from, and only a container of this host.
	struct sks_subnet k = {.prefixlen = 32, .ip = src};
	__be32 *owner = bpf_map_lookup_elem(&sks_subnets, &k);
	if (!owner || *owner != ip->saddr) {
		count(SKS_SYN_SPOOFED);
		return TC_ACT_SHOT;
	}
	if ((dst & cfg_local_mask) != cfg_local_net || !port) {
		count(SKS_SYN_MALFORMED);
		return TC_ACT_SHOT;
	}
	struct sks_pending p = {.dst_ip = dst, .src_ip = src, .dst_port = port};
	bpf_map_update_elem(&sks_syns, &t, &p, BPF_ANY);
	count(SKS_SYN_RECORDED);
	return TC_ACT_UNSPEC;
}

SEC("sk_lookup")
int sks_lookup(struct bpf_sk_lookup *ctx)
{
	if (ctx->family != AF_INET)
		return SK_PASS;
	if (ctx->protocol != IPPROTO_TCP) {
		// Only TCP is steered: a datagram for a container's address got
		// here through the steering route with a TOS the layer did not set
		// (on an interface it does not watch, or from the host itself). No
		// host socket takes it; the kernel answers "port unreachable".
		if (!local_container(ctx->local_ip4))
			return SK_PASS;
		count(SKS_OVERLAY_REFUSED);
		return SK_DROP;
	}
	__u32 zero = 0;
	__u32 *probing = bpf_map_lookup_elem(&sks_probing, &zero);
	if (probing && *probing)
		return SK_DROP; // connection_for asks for connections only
	struct sks_tuple t = {
		.saddr = ctx->remote_ip4,
		.daddr = ctx->local_ip4,
		.sport = (__u16)ctx->remote_port, // be16
		.dport = bpf_htons((__u16)ctx->local_port),
	};
	struct sks_key k = {};
	// The entry stays until the connection is established: a syncookie ACK
	// or a retransmitted SYN is steered the same way.
	struct sks_pending *p = bpf_map_lookup_elem(&sks_syns, &t);
	if (p) {
		k.ip = p->dst_ip;
		k.port = p->dst_port;
	} else if (local_container(ctx->local_ip4)) {
		k.ip = ctx->local_ip4; // overlay traffic routed to this host's stack
		k.port = t.dport;
	} else if (ctx->local_ip4 == cfg_same_host) {
		// A same-host connection whose record is gone (its client's
		// connect failed, or a flood of pending connects evicted it from
		// the LRU): refused (RST), never a host socket on the port.
		count(SKS_SAME_HOST_UNRECORDED);
		return SK_DROP;
	} else {
		return SK_PASS;
	}
	// The client's host judged the connection at connect4, but a host
	// that was bypassed (a forged SYN) or runs another policy version
	// would let through what this host denies: a recorded SYN is judged
	// here too, by the same rules (refused, like connect4, while no policy
	// is in force). Only recorded SYNs: overlay ones are judged on INPUT.
	// The record goes, as without a listener; a retransmit is judged anew.
	if (p && !allowed(p->src_ip, p->dst_ip, p->dst_port)) {
		bpf_map_delete_elem(&sks_syns, &t);
		count(SKS_SYN_DENIED);
		return SK_DROP;
	}
	struct bpf_sock *sk = bpf_map_lookup_elem(&sks_listen, &k);
	if (!sk) {
		if (p) {
			// The listener closed: the kernel answers with a RST. Never
			// a host socket on the port (SK_PASS would look one up).
			// The record goes: the client's connect fails, and a later
			// plain SYN of the tuple (a host process on lo, where no
			// recorder runs) must not find it. A retransmit of an
			// option SYN records it again.
			bpf_map_delete_elem(&sks_syns, &t);
			count(SKS_NO_LISTENER);
			return SK_DROP;
		}
		// A container's address reaches a replaced listener or nothing:
		// never a host socket listening on every address (a listener
		// that closed after the packet was steered, a forged TOS).
		count(SKS_OVERLAY_REFUSED);
		return SK_DROP;
	}
	long err = bpf_sk_assign(ctx, sk, 0);
	bpf_sk_release(sk);
	if (err)
		return SK_DROP; // as without a listener
	count(p ? SKS_ASSIGNED : SKS_OVERLAY_ASSIGNED);
	return SK_PASS;
}

// for_container returns the IPv4 header of a packet for a container of
// this host, NULL for anything else.
static __always_inline struct iphdr *for_container(struct __sk_buff *skb)
{
	struct iphdr *ip = ipv4_of(skb);
	return ip && local_container(ip->daddr) ? ip : NULL;
}

// replaced_listener returns the replaced listener at a segment's
// destination (a reference to release), or NULL.
static __always_inline struct bpf_sock *replaced_listener(struct iphdr *ip, struct tcphdr *th)
{
	struct sks_key k = {.ip = ip->daddr, .port = th->dest};
	return bpf_map_lookup_elem(&sks_listen, &k);
}

// syncookie_ack says whether a segment that found no connection completes
// a handshake that a replaced listener answered with a syncookie (under a
// SYN flood it keeps no request for it). Only the listener can tell, by the
// cookie: the same port may be a container's own client's.
static __always_inline bool syncookie_ack(struct iphdr *ip, struct tcphdr *th)
{
	if (!th->ack || th->syn || th->rst)
		return false;
	struct bpf_sock *l = replaced_listener(ip, th);
	if (!l)
		return false;
	long err = bpf_tcp_check_syncookie(l, ip, sizeof(*ip), th, sizeof(*th));
	bpf_sk_release(l);
	if (err)
		return false;
	count(SKS_SYNCOOKIE_STEERED);
	return true;
}

// connection_for says whether the host stack has a connection (or a
// request, or a TIME_WAIT) for a segment to a container. Only containers
// that had a replaced listener can have one. The kernel's lookup ends in
// the listener path when it finds no connection, which runs sks_lookup:
// sks_probing has that answer "none" at once, so a listener is never
// returned, the host's own ones on every address included.
static __always_inline bool connection_for(struct __sk_buff *skb, struct iphdr *ip, struct tcphdr *th)
{
	if (!bpf_map_lookup_elem(&sks_served, &ip->daddr))
		return false;
	__u32 zero = 0;
	__u32 *probing = bpf_map_lookup_elem(&sks_probing, &zero);
	if (!probing)
		return false;
	struct bpf_sock_tuple t = {.ipv4 = {.saddr = ip->saddr, .daddr = ip->daddr, .sport = th->source, .dport = th->dest}};
	*probing = 1;
	struct bpf_sock *sk = bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	*probing = 0;
	// A listener comes back only where sks_lookup is not attached (tests).
	bool found = sk && sk->state != BPF_TCP_LISTEN;
	if (sk)
		bpf_sk_release(sk);
	return found || syncookie_ack(ip, th);
}

// for_host_stack says whether a packet for a container belongs to a
// replaced listener or to a connection accepted from one. Only a SYN goes
// by the listener's overlay address and port: other segments to that port
// may be a container's own connection that happens to use it (replies to a
// fallback client). Those go by their 4-tuple (connection_for).
static __always_inline bool for_host_stack(struct __sk_buff *skb, struct iphdr *ip)
{
	void *data_end = (void *)(long)skb->data_end;
	if (ip->protocol != IPPROTO_TCP)
		return false;
	struct tcphdr *th = (void *)ip + ip->ihl * 4;
	if ((void *)(th + 1) > data_end)
		return false;
	if (!th->syn || th->ack)
		return connection_for(skb, ip, th);
	struct bpf_sock *sk = replaced_listener(ip, th);
	if (!sk)
		return false;
	bpf_sk_release(sk);
	return true;
}

// route_container_packet decides where a packet for a container goes.
// Overlay packets for a replaced listener, or for a connection accepted
// from one, go to the host stack instead of the container: their TOS gets
// cfg_tos, which a local route of the host (table local) matches, so they
// are delivered locally, where sk_lookup (above) finds the listener and the
// established lookup the connection. So a container on the overlay — a
// fallback socket, no shim, another mode — reaches a replaced listener as
// it would a plain one. A route rather than a rule for a mark: with any
// routing rule of its own, the host looks up every route through the rule
// list (docs/sockets.md). With judge, the mark lets the overlay's policy
// judge the packet on INPUT, as it judges the overlay's on FORWARD.
//
// Any other packet with those TOS bits loses one (a DSCP of the form xxx111
// reaches the container one lower). Returns whether the packet is for the
// host stack.
static __always_inline bool route_container_packet(struct __sk_buff *skb, struct iphdr *ip, bool judge)
{
	if (!for_host_stack(skb, ip)) {
		keep_off_route(ip);
		return false;
	}
	set_tos(ip, ip->tos | cfg_tos);
	if (judge)
		skb->mark = cfg_mark;
	count(SKS_OVERLAY_STEERED);
	return true;
}

SEC("tc")
int sks_from_overlay(struct __sk_buff *skb)
{
	struct iphdr *ip = for_container(skb);
	if (ip && route_container_packet(skb, ip, true))
		return TC_ACT_OK; // the host stack's, by its route
	return TC_ACT_UNSPEC;
}

// into_lo turns a packet for the host stack into lo's ingress, where its
// TOS routes it locally. lo accepts sources that are local addresses
// (accept_local), which routing the packet on the bridge would refuse: the
// reverse route of a container of this host is then the local route too.
static __always_inline int into_lo(struct iphdr *ip)
{
	struct ethhdr *eth = (void *)ip - sizeof(*eth); // for_container checked it
	// lo's address is all zeros: any other destination is another host's.
	for (int i = 0; i < ETH_ALEN; i++)
		eth->h_dest[i] = 0;
	return bpf_redirect(LOOPBACK_IFINDEX, BPF_F_INGRESS);
}

// pull makes the first len bytes of a packet direct-readable, for a
// packet whose IP header was found past data_end. A packet socket
// (CAP_NET_RAW) can hand the veth a frame whose headers lie in paged data,
// where a check that reads only the linear part would pass them unread.
// The stack's own packets have their headers linear: they never pull.
static __always_inline bool pull(struct __sk_buff *skb, __u32 len)
{
	return len <= skb->len && bpf_skb_pull_data(skb, len) == 0;
}

// container_tcp_refused says whether a container's TCP segment must be
// dropped because it could carry skiff's option past this check, or is
// the option SYN itself (forged: only sockops writes it, on host sockets).
// Masqueraded to the host's address on its way to another host, it would
// pass that host's check of the claimed source. Refused:
//   - every TCP fragment: none shows the option, but the host reassembles
//     them and re-fragments the SYN with the option whole in a first
//     fragment (an 8-byte first fragment shows only the ports). A
//     container's TCP stack never sends one (it sizes segments to the
//     route's MTU, with DF); large UDP datagrams and other fragments pass;
//   - a segment whose header is cut short, or a SYN whose data offset is
//     below 5 or past the packet: the stack would drop them too, and the
//     option's place cannot be judged.
static __always_inline bool container_tcp_refused(struct __sk_buff *skb, struct iphdr *ip)
{
	if (fragment(ip)) {
		count(SKS_TCP_FRAGMENT);
		return true;
	}
	__u32 ihl = ip->ihl * 4, len = bpf_ntohs(ip->tot_len);
	// A header in paged data (see pull) is copied out rather than
	// pulled: a pull would move the packet under the caller's pointers.
	struct tcphdr copy, *th = tcp_of(skb, ip);
	if (!th) {
		if (bpf_skb_load_bytes(skb, sizeof(struct ethhdr) + ihl, &copy, sizeof(copy)))
			goto malformed;
		th = &copy;
	}
	// A BIG TCP segment (GSO) leaves tot_len 0: never a SYN.
	if (len && len < ihl + sizeof(*th))
		goto malformed;
	if (!th->syn || th->ack)
		return false;
	if (th->doff < 5 || ihl + th->doff * 4 > len)
		goto malformed;
	struct sks_opt o;
	if (syn_option(skb, ip, th, &o)) {
		count(SKS_SYN_FORGED);
		return true;
	}
	return false;
malformed:
	count(SKS_TCP_MALFORMED);
	return true;
}

// A local container's packets: refused if they could carry the option
// (above); for a replaced listener on this host, to the host stack.
SEC("tc")
int sks_from_container(struct __sk_buff *skb)
{
	struct iphdr *ip = ipv4_of(skb);
	if (!ip && skb->protocol == bpf_htons(ETH_P_IP) && pull(skb, sizeof(struct ethhdr) + sizeof(struct iphdr)))
		ip = ipv4_of(skb);
	if (!ip)
		return TC_ACT_UNSPEC;
	if (ip->protocol == IPPROTO_TCP && container_tcp_refused(skb, ip))
		return TC_ACT_SHOT;
	if (!local_container(ip->daddr) || !route_container_packet(skb, ip, true))
		return TC_ACT_UNSPEC;
	return into_lo(ip);
}

// The host's own connections to a local container (a kubelet probe, a
// host-network process) leave the host stack on the bridge, where the
// container has no listener when its listener was replaced. On the
// bridge's egress they are turned back into the host stack, unmarked: the
// policy judges them no more than the host's packets to any container.
// Only packets a local socket sent qualify; forwarded ones carry no socket.
SEC("tc")
int sks_from_host(struct __sk_buff *skb)
{
	if (!skb->sk)
		return TC_ACT_UNSPEC;
	struct iphdr *ip = for_container(skb);
	if (!ip || !route_container_packet(skb, ip, false))
		return TC_ACT_UNSPEC;
	return into_lo(ip);
}

#include "iter_tcp.h"

static __always_inline struct sks_info *iter_info(struct sock_common *skc, struct tcp_sock **tp)
{
	if (!skc || skc->skc_family != AF_INET)
		return NULL;
	*tp = bpf_skc_to_tcp_sock(skc);
	if (!*tp)
		return NULL;
	return bpf_sk_storage_get(&sks_storage, *tp, 0, 0);
}

SEC("iter/tcp")
int sks_dump(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	struct tcp_sock *tp;
	struct sks_info *si = iter_info(skc, &tp);
	if (!si)
		return 0;
	struct sks_sock s = {
		.cookie = bpf_get_socket_cookie(skc),
		.local_ip = si->local_ip,
		.peer_ip = si->peer_ip,
		.local_port = bpf_ntohs(si->local_port),
		.peer_port = bpf_ntohs(si->peer_port),
		.role = si->role,
		.state = skc->skc_state,
	};
	bpf_seq_write(ctx->meta->seq, &s, sizeof(s));
	return 0;
}

SEC("iter/tcp")
int sks_destroy(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	if (!skc)
		return 0;
	__u64 cookie = bpf_get_socket_cookie(skc);
	if (!bpf_map_lookup_elem(&sks_kill, &cookie))
		return 0;
	if (bpf_sock_destroy(skc) == 0)
		count(SKS_DESTROYED);
	return 0;
}
