//go:build ignore

// skiff's steering layer (Falcon, paper 003 ch. 3, on a stock kernel): the
// stages of one overlay flow's receive path run on different CPUs. The
// kernel applies a device's RPS map (rps_cpus) when a packet is queued for
// that device, with the packet's hash; a program on one stage's device
// writes the hash (bpf_set_hash, kept through decapsulation and veths) that
// makes the next device's RPS land on the CPU it picks:
//   stx_underlay     underlay ingress: for VXLAN packets of the overlay,
//                    picks the CPU of the skiff.vxlan stage from the inner
//                    flow (counts the underlay stage)
//   stx_to_container host veth egress: picks the CPU of the container's
//                    eth0 stage
//   stx_vxlan, stx_container: count their stage on the CPU that runs it
// The pick hashes the inner flow with the device's identity (its ifindex),
// as Falcon does, so consecutive stages of one flow spread; Falcon's
// two-choice rule takes a second CPU when the first is loaded (loads
// sampled by the agent); a first choice that is the CPU already running the
// packet gives way to the next one below the threshold. A light flow (few
// bytes a window: request/response) gets hash 0, for which RPS picks no
// CPU: its next stage runs on this CPU at once.
// Every program leaves the packet to the next one (TCX_NEXT) and never
// changes it but for its hash. Non-IPv4, truncated and foreign packets are
// counted and left alone.

#include <stdbool.h>
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "steering.h"

char __license[] SEC("license") = "GPL";

#define TCX_NEXT (-1)

volatile const __be16 cfg_vxlan_port; // network order
volatile const __u32 cfg_vni;         // host order
volatile const __be32 cfg_underlay_ip;
volatile const __u32 cfg_record;      // tests: keep the last decision in stx_recorded

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct stx_cfg);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} stx_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct stx_load);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} stx_loads SEC(".maps");

// Packets of each stage, per CPU: where the stages ran.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, STX_NSTAGES);
	__type(key, enum stx_stage);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} stx_stages SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, STX_NREASONS);
	__type(key, enum stx_reason);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} stx_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct stx_last);
} stx_recorded SEC(".maps");

// Flows by their hash salted with the device: each stage judges a flow's
// weight at its own device.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct stx_flow);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} stx_flows SEC(".maps");

static __always_inline void bump(void *map, __u32 k)
{
	__u64 *v = bpf_map_lookup_elem(map, &k);
	if (v)
		*v += 1;
}

static __always_inline __u32 mix32(__u32 h)
{
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	h ^= h >> 16;
	return h;
}

// The index reciprocal_scale gives h among n (get_rps_cpu's choice).
static __always_inline __u32 scale(__u32 h, __u32 n) { return (__u32)(((__u64)h * n) >> 32); }

// hash_for_index is a non-zero hash that RPS over n CPUs maps to index idx.
static __always_inline __u32 hash_for_index(__u32 idx, __u32 n)
{
	return (__u32)((((__u64)idx << 32) + n - 1) / n) + 1;
}

// flow_at hashes the IPv4 flow of the Ethernet frame at off: addresses,
// protocol and, unless it is a fragment, TCP/UDP ports. It returns
// STX_FIRST, STX_FRAGMENT (hashed without ports) or why it could not.
static __always_inline __u32 flow_at(struct __sk_buff *skb, __u32 off, __u32 *flow)
{
	struct ethhdr eth;
	struct iphdr ip;
	if (bpf_skb_load_bytes(skb, off, &eth, sizeof(eth)))
		return STX_MALFORMED;
	if (eth.h_proto != bpf_htons(ETH_P_IP))
		return STX_NOT_IPV4;
	off += sizeof(eth);
	if (bpf_skb_load_bytes(skb, off, &ip, sizeof(ip)))
		return STX_MALFORMED;
	if (ip.version != 4 || ip.ihl < 5)
		return STX_MALFORMED;
	__u32 h = mix32(ip.saddr ^ mix32(ip.daddr ^ ip.protocol));
	if (ip.frag_off & bpf_htons(0x3fff)) {
		*flow = h;
		return STX_FRAGMENT;
	}
	if (ip.protocol == IPPROTO_TCP || ip.protocol == IPPROTO_UDP) {
		__u32 ports;
		if (bpf_skb_load_bytes(skb, off + ip.ihl * 4, &ports, sizeof(ports)))
			return STX_MALFORMED;
		h = mix32(h ^ ports);
	}
	*flow = h;
	return STX_FIRST;
}

static __always_inline __u32 load_of(const struct stx_load *l, const struct stx_cfg *c, __u32 idx)
{
	__u32 cpu = c->cpus[idx & (STX_MAX_CPUS - 1)];
	return l->pct[cpu & (STX_MAX_CPUS - 1)];
}

// heavy says whether flow (h1: salted with the device) has carried
// heavy_bytes in the current window or did in the last one: each stage
// moved to another CPU costs a hand-over (an IPI, a backlog pass), which
// a light flow (request/response) does not win back.
static __always_inline bool heavy(const struct stx_cfg *c, __u32 h1, __u32 len)
{
	if (!c->heavy_bytes)
		return true;
	__u64 now = bpf_ktime_get_ns();
	struct stx_flow *f = bpf_map_lookup_elem(&stx_flows, &h1);
	if (!f) {
		struct stx_flow n = {.start = now, .bytes = len, .heavy = len >= c->heavy_bytes};
		bpf_map_update_elem(&stx_flows, &h1, &n, BPF_ANY);
		return n.heavy;
	}
	if (now - f->start > c->window_ns) {
		// The window closed: heavy if it was, and it ended just now.
		f->heavy = f->bytes >= c->heavy_bytes && now - f->start <= 2 * (__u64)c->window_ns;
		f->start = now;
		f->bytes = 0;
	}
	f->bytes += len;
	if (f->bytes >= c->heavy_bytes)
		f->heavy = 1;
	return f->heavy;
}

// this_index is the index of the CPU running the program among c->cpus
// (n when it is not one of them).
static __always_inline __u32 this_index(const struct stx_cfg *c)
{
	__u32 cpu = bpf_get_smp_processor_id(), n = c->n;
	for (__u32 i = 0; i < STX_MAX_CPUS && i < n; i++)
		if (c->cpus[i] == cpu)
			return i;
	return n;
}

// pick returns the index (into c->cpus) of the CPU for the next stage of
// flow, salted with the stage's device, and why.
static __always_inline __u32 pick(const struct stx_cfg *c, __u32 flow, __u32 salt, __u32 len, __u32 *reason)
{
	__u32 n = c->n, zero = 0;
	__u32 h1 = mix32(flow ^ salt);
	__u32 idx = scale(h1, n);
	*reason = STX_FIRST;
	if (n < 2)
		return idx;
	if (!heavy(c, h1, len)) {
		__u32 self = this_index(c);
		if (self < n) {
			*reason = STX_LIGHT;
			return self;
		}
	}
	const struct stx_load *l = bpf_map_lookup_elem(&stx_loads, &zero);
	bool fresh = l && l->stamp_ns && bpf_ktime_get_ns() - l->stamp_ns <= c->stale_ns;
	if (!fresh)
		bump(&stx_stats, STX_STALE_LOAD);
	if (fresh && load_of(l, c, idx) >= c->threshold) {
		// Falcon's second choice, made a different CPU (a plain re-hash
		// returns the same one half the time on two).
		__u32 second = (idx + 1 + mix32(h1) % (n - 1)) % n;
		if (load_of(l, c, second) < load_of(l, c, idx)) {
			*reason = STX_SECOND;
			return second;
		}
	}
	if (c->cpus[idx & (STX_MAX_CPUS - 1)] == bpf_get_smp_processor_id()) {
		__u32 next = (idx + 1) % n;
		if (!fresh || load_of(l, c, next) < c->threshold) {
			*reason = STX_SELF_AVOIDED;
			return next;
		}
	}
	return idx;
}

// steer sets the hash that sends the flow's next stage to the CPU picked.
static __always_inline void steer(struct __sk_buff *skb, const struct stx_cfg *c, __u32 flow)
{
	__u32 reason, idx = pick(c, flow, skb->ifindex, skb->len, &reason);
	// A light flow gets hash 0, which RPS takes for none: the next device
	// processes it at once on this CPU, without a backlog pass.
	__u32 hash = reason == STX_LIGHT ? 0 : hash_for_index(idx, c->n);
	bpf_set_hash(skb, hash);
	bump(&stx_stats, reason);
	if (cfg_record) {
		__u32 zero = 0;
		struct stx_last last = {.hash = hash, .idx = idx, .cpu = c->cpus[idx & (STX_MAX_CPUS - 1)], .reason = reason, .flow = flow};
		bpf_map_update_elem(&stx_recorded, &zero, &last, BPF_ANY);
	}
}

static __always_inline const struct stx_cfg *config(void)
{
	__u32 zero = 0;
	const struct stx_cfg *c = bpf_map_lookup_elem(&stx_config, &zero);
	return c && c->n && c->n <= STX_MAX_CPUS ? c : NULL;
}

// steer_frame steers the flow of the Ethernet frame at off.
static __always_inline int steer_frame(struct __sk_buff *skb, __u32 off)
{
	const struct stx_cfg *c = config();
	if (!c)
		return TCX_NEXT;
	__u32 flow, r = flow_at(skb, off, &flow);
	if (r == STX_FRAGMENT)
		bump(&stx_stats, r);
	else if (r != STX_FIRST) {
		bump(&stx_stats, r);
		return TCX_NEXT;
	}
	steer(skb, c, flow);
	return TCX_NEXT;
}

#define VXLAN_HLEN 8

SEC("tc")
int stx_underlay(struct __sk_buff *skb)
{
	struct ethhdr eth;
	struct iphdr ip;
	struct udphdr udp;
	__u32 vx[2];
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) || eth.h_proto != bpf_htons(ETH_P_IP) ||
	    bpf_skb_load_bytes(skb, sizeof(eth), &ip, sizeof(ip)) || ip.version != 4 || ip.ihl < 5 ||
	    ip.protocol != IPPROTO_UDP || (ip.frag_off & bpf_htons(0x3fff)) ||
	    (cfg_underlay_ip && ip.daddr != cfg_underlay_ip)) {
		bump(&stx_stats, STX_NOT_VXLAN);
		return TCX_NEXT;
	}
	__u32 off = sizeof(eth) + ip.ihl * 4;
	if (bpf_skb_load_bytes(skb, off, &udp, sizeof(udp)) || udp.dest != cfg_vxlan_port ||
	    bpf_skb_load_bytes(skb, off + sizeof(udp), vx, sizeof(vx)) || !(vx[0] & bpf_htonl(0x08000000)) ||
	    bpf_ntohl(vx[1]) >> 8 != cfg_vni) {
		bump(&stx_stats, STX_NOT_VXLAN);
		return TCX_NEXT;
	}
	bump(&stx_stages, STX_STAGE_UNDERLAY);
	return steer_frame(skb, off + sizeof(udp) + VXLAN_HLEN);
}

SEC("tc")
int stx_vxlan(struct __sk_buff *skb)
{
	bump(&stx_stages, STX_STAGE_VXLAN);
	return TCX_NEXT;
}

SEC("tc")
int stx_to_container(struct __sk_buff *skb)
{
	return steer_frame(skb, 0);
}

SEC("tc")
int stx_container(struct __sk_buff *skb)
{
	bump(&stx_stages, STX_STAGE_CONTAINER);
	return TCX_NEXT;
}
