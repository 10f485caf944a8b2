// Part of sockets.c (one bpf2go unit): the socket iterators: list and end replaced connections.
#pragma once

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
