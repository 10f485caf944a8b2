// Part of sockets.c (one bpf2go unit): the cgroup hooks of a container's host sockets: create, connect, bind, names, options, release.
#pragma once

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
