//go:build ignore

// Fast channels between containers of one host (DockNet §3.1, in the
// kernel): when both ends of an established TCP connection are local
// containers, what one end sends is queued straight on the other end's
// socket (sk_msg redirect), skipping both TCP stacks, the veths and the
// bridge.
//   skch_sockops  sockops on the cgroup v2 root: a TCP socket of an IPv4
//                 connection (AF_INET, or AF_INET6 with mapped addresses) that
//                 reaches ESTABLISHED in the namespace of a local
//                 container, with that container's address, and whose peer
//                 is a local container that may take a channel, joins
//                 skch_socks under its 4-tuple (when the agent registers
//                 the containers' namespaces: Options.Containers); so does a host
//                 socket of the sockets layer (host namespace, in a local
//                 container's cgroup) connected to this host itself. Nothing
//                 else does: a socket in a socket hash sends through the
//                 sk_msg path for as long as it lives, which a connection to
//                 another host would pay for on every write for nothing;
//                 nor does a socket that asked to stay out
//                 (SKIFF_SO_NOCHANNEL: the seccomp agent's host sockets).
//   skch_msg      sk_msg verdict of skch_socks: a send goes to the peer's
//                 socket (the reversed 4-tuple) when the peer is in the
//                 map and both ends' containers may take a channel
//                 (skch_ips: no rate limit), else through TCP; per
//                 direction the choice is made once and can only fall
//                 back (skch_state).
//   skch_setsockopt cgroup/setsockopt on the cgroup v2 root: a socket that
//                 asks for zero-copy sends (SO_ZEROCOPY: their completions
//                 would never come from a channel) or an upper layer
//                 protocol (TCP_ULP: kTLS) sends through TCP from then on;
//                 one that sets SKIFF_SO_NOCHANNEL never joins (skch_out).
//   skch_destroy  iter/tcp, run in a container's namespace: ends the
//                 channelled connections a new policy denies
//                 (bpf_sock_destroy), as the sockets layer ends its own.
// A socket leaves the map when it closes (the kernel's sockmap close).

#include <stdbool.h>
#include <linux/bpf.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "channels.h"
#include "skiff_sockopt.h"

char __license[] SEC("license") = "GPL";

volatile const __u64 cfg_host_netns; // the host's namespace: host sockets

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 65536);
	__type(key, struct skch_key);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skch_socks SEC(".maps");

// Local containers' namespaces (netns cookie) and their addresses.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skch_netns SEC(".maps");

// Local containers' cgroups (cgroup v2 id) and their addresses: a host
// socket in one is that container's (the sockets layer's broker made it).
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skch_cgroups SEC(".maps");

// The container of each host socket in skch_socks, by its key: what the
// peer's sends check (entries of closed sockets age out; a missing one
// sends through TCP).
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct skch_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skch_owners SEC(".maps");

// Addresses of local containers whose traffic may take a channel (not
// those with a rate limit: a channel would skip it). A direction whose
// either end is not here falls back to TCP at its next write.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skch_ips SEC(".maps");

// Sockets skch_destroy ends (socket cookies), written by the agent.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, __u8);
} skch_kill SEC(".maps");

// Each joined socket's side, kind and directions' state, pinned: a
// restarted agent's programs must see a direction that fell back as on
// TCP, or it could take the channel again and reorder bytes.
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct skch_sock);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skch_dir SEC(".maps");

// Sockets that set SKIFF_SO_NOCHANNEL, and the connections a listener
// among them accepts (BPF_F_CLONE): they never join skch_socks. The
// sockets layer's seccomp agent sets it on each host socket it takes: a
// channelled socket's blocking read can fail with a spurious EAGAIN on
// this kernel, and a program under the seccomp profile has no shim to
// retry it. Pinned: a restarted agent still leaves them out.
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC | BPF_F_CLONE);
	__type(key, int);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skch_out SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, SKCH_NCOUNTERS);
	__type(key, enum skch_counter);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skch_stats SEC(".maps");

static __always_inline void count(enum skch_counter c)
{
	__u32 k = c;
	__u64 *v = bpf_map_lookup_elem(&skch_stats, &k);
	if (v)
		*v += 1;
}

#include "sock_cgroup.h"
#include "iter_tcp.h"

// owner returns the local container a socket that reached ESTABLISHED
// belongs to (its address), or 0: a socket in a registered container
// namespace with that container's address, or a host socket in a
// registered container cgroup.
static __always_inline __u32 owner(struct bpf_sock_ops *skops, bool *host)
{
	__u64 ns = bpf_get_netns_cookie(skops);
	if (ns == cfg_host_netns) {
		// The sockets layer's brokers make AF_INET sockets only.
		struct bpf_sock *bsk = skops->sk;
		if (!bsk || skops->family != 2 /* AF_INET */)
			return 0;
		__u64 cg = sock_cgroup(bpf_skc_to_tcp_sock(bsk));
		__u32 *ip = bpf_map_lookup_elem(&skch_cgroups, &cg);
		*host = true;
		return ip ? *ip : 0;
	}
	__u32 *ip = bpf_map_lookup_elem(&skch_netns, &ns);
	*host = false;
	return ip && *ip == skops->local_ip4 ? *ip : 0;
}

// An IPv4 connection: of an AF_INET socket, or of an AF_INET6 one with
// IPv4-mapped addresses (a dual-stack listener's, as Go's and nginx's
// [::] listeners make), whose IPv4 addresses the kernel keeps as an
// AF_INET socket's.
static __always_inline bool ipv4(struct bpf_sock_ops *skops)
{
	if (skops->family == 2 /* AF_INET */)
		return true;
	return skops->family == 10 /* AF_INET6 */ && !skops->local_ip6[0] && !skops->local_ip6[1] &&
	       skops->local_ip6[2] == bpf_htonl(0xffff) && !skops->remote_ip6[0] && !skops->remote_ip6[1] &&
	       skops->remote_ip6[2] == bpf_htonl(0xffff);
}

// local_peer says whether a socket's peer is on this host, so that the
// connection may take a channel: a container socket's peer is a local
// container without a rate limit (skch_ips); a host socket's is on lo —
// the sockets layer binds a same-host connection's client to the address
// it sends the connection to (sockets.SameHostAddr), so both ends read
// the same address. Anything else stays out of the socket hash.
static __always_inline bool local_peer(struct bpf_sock_ops *skops, bool host)
{
	if (host)
		return skops->remote_ip4 == skops->local_ip4;
	__u32 peer = skops->remote_ip4;
	return bpf_map_lookup_elem(&skch_ips, &peer) != NULL;
}

SEC("sockops")
int skch_sockops(struct bpf_sock_ops *skops)
{
	if (skops->op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB && skops->op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB)
		return 1;
	if (!ipv4(skops))
		return 1;
	bool host;
	__u32 ip = owner(skops, &host);
	if (!ip)
		return 1;
	if (!local_peer(skops, host)) {
		count(SKCH_REMOTE);
		return 1;
	}
	struct bpf_sock *bsk = skops->sk;
	if (bsk && bpf_sk_storage_get(&skch_out, bsk, 0, 0)) {
		count(SKCH_OPTED_OUT);
		return 1;
	}
	bool client = skops->op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB;
	struct skch_key k = {
		.sip = skops->local_ip4,
		.dip = skops->remote_ip4,
		.sport = skops->local_port,
		.dport = bpf_ntohl(skops->remote_port),
		.host = host,
		.client = client,
	};
	struct skch_sock *s = bsk ? bpf_sk_storage_get(&skch_dir, bsk, 0, BPF_SK_STORAGE_GET_F_CREATE) : NULL;
	if (!s || (host && bpf_map_update_elem(&skch_owners, &k, &ip, BPF_ANY))) {
		count(SKCH_ADD_FAILED);
		return 1;
	}
	s->host = host;
	s->client = client;
	s->ip = ip;
	if (bpf_sock_hash_update(skops, &skch_socks, &k, BPF_NOEXIST)) {
		if (host)
			bpf_map_delete_elem(&skch_owners, &k);
		count(SKCH_ADD_FAILED);
		return 1;
	}
	count(SKCH_ADDED);
	return 1;
}

// fall_back sends a direction through TCP from now on.
static __always_inline int fall_back(struct skch_sock *s)
{
	count(s->state == SKCH_CHANNEL ? SKCH_FELL_BACK : SKCH_TCP_NO_PEER);
	s->state = SKCH_TCP;
	return SK_PASS;
}

SEC("sk_msg")
int skch_msg(struct sk_msg_md *msg)
{
	// skch_sockops gave every socket it joined its storage.
	struct skch_sock *s = bpf_sk_storage_get(&skch_dir, msg->sk, 0, 0);
	if (!s || s->state == SKCH_TCP)
		return SK_PASS;
	__u32 local = msg->local_ip4, remote = msg->remote_ip4;
	struct skch_key peer = {
		.sip = remote,
		.dip = local,
		.sport = bpf_ntohl(msg->remote_port),
		.dport = msg->local_port,
		.host = s->host,
		.client = !s->client,
	};
	// The containers at both ends: a container socket's addresses, or the
	// owners recorded for host sockets.
	if (s->host) {
		__u32 *other = bpf_map_lookup_elem(&skch_owners, &peer);
		if (!other)
			return fall_back(s);
		local = s->ip;
		remote = *other;
	}
	if (!bpf_map_lookup_elem(&skch_ips, &local) || !bpf_map_lookup_elem(&skch_ips, &remote))
		return fall_back(s);
	// No redirect set when the peer is not in the map: SK_PASS then sends
	// through TCP.
	if (bpf_msg_redirect_hash(msg, &skch_socks, &peer, BPF_F_INGRESS) != SK_PASS)
		return fall_back(s);
	s->state = SKCH_CHANNEL;
	count(SKCH_REDIRECTED);
	return SK_PASS;
}

#define SOL_SOCKET 1
#define SO_ZEROCOPY 60
#define SOL_TCP 6
#define TCP_ULP 31

SEC("cgroup/setsockopt")
int skch_setsockopt(struct bpf_sockopt *ctx)
{
	if (ctx->level == SKIFF_SOL && ctx->optname == SKIFF_SO_NOCHANNEL) {
		// Taken here, never by the kernel (optlen -1), whatever the
		// value; refused (EPERM) when the mark cannot be stored, so that
		// the caller does not count on it.
		struct bpf_sock *sk = ctx->sk;
		__u8 *out = sk ? bpf_sk_storage_get(&skch_out, sk, 0, BPF_SK_STORAGE_GET_F_CREATE) : NULL;
		if (!out)
			return 0;
		*out = 1;
		ctx->optlen = -1;
		return 1;
	}
	if (!(ctx->level == SOL_SOCKET && ctx->optname == SO_ZEROCOPY) && !(ctx->level == SOL_TCP && ctx->optname == TCP_ULP))
		return 1;
	struct bpf_sock *sk = ctx->sk;
	if (!sk || (sk->family != 2 /* AF_INET */ && sk->family != 10 /* AF_INET6 */) || sk->protocol != 6 /* TCP */)
		return 1;
	struct skch_sock *s = bpf_sk_storage_get(&skch_dir, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (s && s->state != SKCH_TCP) {
		if (s->state == SKCH_CHANNEL)
			count(SKCH_FELL_BACK);
		s->state = SKCH_TCP;
		count(SKCH_SOCKOPT);
	}
	return 1;
}

SEC("iter/tcp")
int skch_destroy(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	if (!skc || (skc->skc_family != 2 /* AF_INET */ && skc->skc_family != 10 /* AF_INET6 */))
		return 0;
	__u64 cookie = bpf_get_socket_cookie(skc);
	if (!bpf_map_lookup_elem(&skch_kill, &cookie))
		return 0;
	if (bpf_sock_destroy(skc) == 0)
		count(SKCH_DESTROYED);
	return 0;
}
