// Part of sockets.c (one bpf2go unit): sk_lookup: a recorded SYN to its replaced listener.
#pragma once

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
