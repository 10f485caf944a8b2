//go:build ignore

// Rate limits of the paths that pass no skiff qdisc: a container's host
// sockets (the sockets layer) skip its veth and the HTB qdiscs there
// (shape.go). On the container's cgroup:
//   skl_egress   cgroup_skb egress: a token bucket per container, refilled
//                at its rate. Over the limit, TCP is told to wait (drop with
//                congestion notification: the segment stays in the socket's
//                queue, TCP backs off — shaping, no loss); anything else is
//                dropped.
//   skl_classify tc ingress of the underlay and of lo (host sockets'
//                packets arrive there): a packet for a host socket of a
//                container with an ingress limit is redirected through an
//                IFB device, whose HTB class for the container shapes it (a
//                queue, not drops: policing a TCP receiver costs it most of
//                its rate, as GRO makes each drop dozens of segments); the
//                IFB gives it back to the device's ingress, past tc.
//   skl_ingress  cgroup_skb ingress: the same bucket for what the container
//                receives, a backstop over every path: over the limit it is
//                dropped.
//   skl_sockops  a host TCP socket of a limited container is paced at the
//                egress rate from its establishment (SO_MAX_PACING_RATE:
//                TCP's internal pacing, no fq needed), so one connection
//                keeps to the rate smoothly and the bucket seldom acts.
//                A container's QoS class gives its host sockets the class's
//                TOS (DSCP) and priority (qos.c marks the VXLAN path).
//   skl_pace     iter/tcp over the host's sockets: applies a changed rate
//                or class to connections already established.
// Both buckets see every packet of the cgroup's sockets in any namespace:
// its container-namespace traffic, already shaped to the rate by HTB,
// passes them within the headroom the agent gives (rates are set a little
// above the limit), so host sockets and container sockets together keep to
// the limit.

#include <stdbool.h>
#include <stddef.h>
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "limits.h"
#include "bucket.h"

char __license[] SEC("license") = "GPL";

volatile const __u64 cfg_host_netns; // netns cookie of the host namespace

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64); // cgroup id
	__type(value, struct skl_limit);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skl_limits SEC(".maps");

// The IFB's ifindex (one entry; 0: none): limits.Cgroups.ifb writes it.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skl_ifb SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64); // cgroup id
	__type(value, struct skl_bucket);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skl_buckets SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, SKL_NCOUNTERS);
	__type(key, enum skl_counter);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skl_stats SEC(".maps");

static __always_inline void count(enum skl_counter c)
{
	__u32 k = c;
	__u64 *v = bpf_map_lookup_elem(&skl_stats, &k);
	if (v)
		*v += 1;
}


// take charges len bytes to a bucket direction; false: over the limit.
// take takes len bytes from cg's bucket for dir (bucket.h).
static __always_inline bool take(__u64 cg, const struct skl_limit *l, int dir, __u32 len)
{
	if (dir != SKL_EGRESS && dir != SKL_INGRESS)
		return true;
	__u64 rate = l->rate[dir], burst = l->burst[dir];
	if (!rate)
		return true;
	struct skl_bucket *b = bpf_map_lookup_elem(&skl_buckets, &cg);
	if (!b) {
		struct skl_bucket fresh = {};
		fresh.tokens[0] = l->burst[0];
		fresh.tokens[1] = l->burst[1];
		bpf_map_update_elem(&skl_buckets, &cg, &fresh, BPF_NOEXIST);
		b = bpf_map_lookup_elem(&skl_buckets, &cg);
		if (!b)
			return true; // a full map limits nothing rather than everything
	}
	__u64 now = bpf_ktime_get_ns();
	bpf_spin_lock(&b->lock);
	bool ok = bucket_take(&b->tokens[dir], &b->last[dir], rate, burst, len, now);
	bpf_spin_unlock(&b->lock);
	return ok;
}

static __always_inline const struct skl_limit *limit_of(struct __sk_buff *skb, __u64 *cg)
{
	struct bpf_sock *sk = skb->sk;
	if (!sk)
		return NULL;
	*cg = bpf_sk_cgroup_id(sk);
	return bpf_map_lookup_elem(&skl_limits, cg);
}

// cgroup_skb egress verdicts: 1 pass, 0 drop, 2 drop with congestion
// notification (TCP keeps the segment queued and enters CWR).
SEC("cgroup_skb/egress")
int skl_egress(struct __sk_buff *skb)
{
	__u64 cg;
	const struct skl_limit *l = limit_of(skb, &cg);
	if (!l || take(cg, l, SKL_EGRESS, skb->len)) {
		count(SKL_PASSED);
		return 1;
	}
	__u8 proto = 0;
	if (skb->protocol == bpf_htons(0x0800))
		bpf_skb_load_bytes(skb, offsetof(struct iphdr, protocol), &proto, 1);
	if (proto == IPPROTO_TCP) {
		count(SKL_EGRESS_HELD);
		return 2;
	}
	count(SKL_EGRESS_DROPPED);
	return 0;
}

SEC("cgroup_skb/ingress")
int skl_ingress(struct __sk_buff *skb)
{
	__u64 cg;
	const struct skl_limit *l = limit_of(skb, &cg);
	if (!l || take(cg, l, SKL_INGRESS, skb->len)) {
		count(SKL_PASSED);
		return 1;
	}
	count(SKL_INGRESS_DROPPED);
	return 0;
}

#include "sock_cgroup.h"
#include "iter_tcp.h"

#define SOL_SOCKET 1
#define SO_MAX_PACING_RATE 47

#define SOL_IP 0
#define IP_TOS 1
#define SO_PRIORITY 12

// apply sets a TCP socket's pacing rate, TOS and priority from its
// cgroup's entry: the limit and QoS class in force, or none (~0U, 0, 0)
// for a socket whose container has lost them. A new connection (reset
// false) gets only what its container has: an application's own TOS or
// priority stays when the container has a rate limit but no class.
static __always_inline void apply(void *ctx_sk, struct tcp_sock *tp, bool reset)
{
	__u64 cg = sock_cgroup(tp);
	const struct skl_limit *l = bpf_map_lookup_elem(&skl_limits, &cg);
	if (!l)
		return;
	int rate = l->pace, tos = l->tos, prio = l->priority;
	if ((reset || l->pace != ~0U) && bpf_setsockopt(ctx_sk, SOL_SOCKET, SO_MAX_PACING_RATE, &rate, sizeof(rate)) == 0)
		count(SKL_PACED);
	if ((reset || tos || prio) && bpf_setsockopt(ctx_sk, SOL_IP, IP_TOS, &tos, sizeof(tos)) == 0 &&
	    bpf_setsockopt(ctx_sk, SOL_SOCKET, SO_PRIORITY, &prio, sizeof(prio)) == 0 && tos)
		count(SKL_CLASSED);
}

SEC("sockops")
int skl_sockops(struct bpf_sock_ops *skops)
{
	if (skops->op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB && skops->op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB)
		return 1;
	// Container-namespace sockets pass the HTB qdisc of the container's
	// veth, whose rate a pacing rate set once would not follow.
	if (skops->family != 2 /* AF_INET */ || bpf_get_netns_cookie(skops) != cfg_host_netns)
		return 1;
	struct bpf_sock *bsk = skops->sk;
	if (!bsk)
		return 1;
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(bsk);
	if (tp)
		apply(skops, tp, false);
	return 1;
}

// The agent runs it in the host namespace (the iterator walks the
// namespace of the process reading it) after a limit changed.
SEC("iter/tcp")
int skl_pace(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	if (!skc || skc->skc_family != 2)
		return 0;
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(skc);
	if (tp)
		apply(tp, tp, true);
	return 0;
}

#define TC_ACT_UNSPEC (-1)
#define HTB_MAJOR 0x5c // limits/shape.go

SEC("tc")
int skl_classify(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_UNSPEC;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end || ip->protocol != IPPROTO_TCP || ip->ihl != 5)
		return TC_ACT_UNSPEC;
	struct tcphdr *tcp = (void *)(ip + 1);
	if ((void *)(tcp + 1) > end)
		return TC_ACT_UNSPEC;
	struct bpf_sock_tuple t = {.ipv4 = {.saddr = ip->saddr, .daddr = ip->daddr, .sport = tcp->source, .dport = tcp->dest}};
	struct bpf_sock *sk = bpf_sk_lookup_tcp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return TC_ACT_UNSPEC;
	__u64 cg = sock_cgroup(bpf_skc_to_tcp_sock(sk));
	bpf_sk_release(sk);
	const struct skl_limit *l = bpf_map_lookup_elem(&skl_limits, &cg);
	__u32 zero = 0, *ifb = bpf_map_lookup_elem(&skl_ifb, &zero);
	if (!l || !l->class || !ifb || !*ifb)
		return TC_ACT_UNSPEC;
	skb->priority = (HTB_MAJOR << 16) | l->class;
	count(SKL_SHAPED);
	return bpf_redirect(*ifb, 0);
}
