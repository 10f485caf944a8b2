// Part of sockets.c (one bpf2go unit): sockops: the SYN option, listeners published, same-host records, accepted peers.
#pragma once

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
