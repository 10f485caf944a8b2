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
// CPU: its next stage runs on this CPU at once. With udp_batch, a heavy
// UDP flow's batches of packets take the CPUs in turn (mFlow's
// micro-flows; never TCP, which would be reordered).
// Every program leaves the packet to the next one (TC_ACT_UNSPEC) and never
// changes it but for its hash. Non-IPv4, truncated and foreign packets are
// counted and left alone.

#include <stdbool.h>
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "steering.h"

char __license[] SEC("license") = "GPL";

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

// hash_for_index is a non-zero hash that RPS over n (at most 64) CPUs maps
// to index idx: one of the 2^25 values from the bottom of the index's range
// (at least 2^26 wide), taken by the flow's own hash h, so that flows keep
// hashes apart for what else reads them (GRO's buckets, RFS, fanout).
static __always_inline __u32 hash_for_index(__u32 idx, __u32 n, __u32 h)
{
	return (__u32)((((__u64)idx << 32) + n - 1) / n) + 1 + (h & 0x1ffffff);
}

// flow_at hashes the IPv4 flow of the Ethernet frame at off: addresses,
// protocol and, unless it is a fragment, TCP/UDP ports. It returns
// STX_FIRST, STX_FRAGMENT (hashed without ports) or why it could not.
// The seed goes into the first mix: seeded only later, two flows whose
// seed-free hashes collide (found offline, by varying ports and
// addresses) would share a map slot and a CPU whatever the seed.
static __always_inline __u32 flow_at(struct __sk_buff *skb, __u32 off, __u32 seed, __u32 *flow, bool *udp)
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
	__u32 h = mix32(ip.saddr ^ mix32(ip.daddr ^ ip.protocol ^ seed));
	*udp = ip.protocol == IPPROTO_UDP;
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

// track counts a packet of len bytes of flow h1 (salted with the device)
// and returns the flow's entry (NULL: the map took none). A flow is heavy
// when it has carried heavy_bytes in the current window or did in the
// last one: each stage moved to another CPU costs a hand-over (an IPI, a
// backlog pass), which a light flow (request/response) does not win back.
static __always_inline struct stx_flow *track(const struct stx_cfg *c, __u32 h1, __u32 len)
{
	__u64 now = bpf_ktime_get_ns();
	struct stx_flow *f = bpf_map_lookup_elem(&stx_flows, &h1);
	if (!f) {
		struct stx_flow n = {.start = now, .idx = STX_MAX_CPUS};
		bpf_map_update_elem(&stx_flows, &h1, &n, BPF_NOEXIST);
		f = bpf_map_lookup_elem(&stx_flows, &h1);
		if (!f)
			return NULL;
	}
	if (now - f->start > c->window_ns) {
		// The window closed: heavy if it was, and it ended just now.
		f->heavy = f->bytes >= c->heavy_bytes && now - f->start <= 2 * (__u64)c->window_ns;
		f->start = now;
		f->bytes = 0;
		f->idx = STX_MAX_CPUS; // pick again
	}
	f->bytes += len;
	f->pkts++;
	if (f->bytes >= c->heavy_bytes)
		f->heavy = 1;
	return f;
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
static __always_inline __u32 choose(const struct stx_cfg *c, __u32 h1, __u32 *reason);

static __always_inline __u32 pick(const struct stx_cfg *c, __u32 flow, __u32 salt, __u32 len, bool udp, __u32 *reason,
				  __u32 *h)
{
	__u32 n = c->n;
	__u32 h1 = mix32(flow ^ salt ^ c->seed);
	*h = h1;
	*reason = STX_FIRST;
	if (n < 2)
		return scale(h1, n);
	if (!c->heavy_bytes && !c->udp_batch)
		return choose(c, h1, reason);
	struct stx_flow *f = track(c, h1, len);
	if (c->heavy_bytes && (!f || !f->heavy)) {
		__u32 self = this_index(c);
		if (self < n) {
			*reason = STX_LIGHT;
			return self;
		}
	}
	if (!f)
		return choose(c, h1, reason);
	// mFlow's micro-flows: a heavy UDP flow's batches take the CPUs in
	// turn (UDP keeps no order to lose; TCP is never split).
	if (udp && c->udp_batch) {
		*reason = STX_SPLIT;
		return (scale(h1, n) + f->pkts / c->udp_batch) % n;
	}
	// A flow keeps its CPU for the window: a choice made again for every
	// packet, from loads that change, would spread one flow's packets
	// over two backlogs and reorder them.
	if (f->idx < n) {
		*reason = f->reason;
		return f->idx;
	}
	__u32 idx = choose(c, h1, reason);
	f->idx = idx;
	f->reason = *reason;
	return idx;
}

// choose is Falcon's pick for a heavy flow (h1: salted with the device):
// its first choice; the second when the first is loaded and the second
// less so; the next CPU when the first is the one running the program.
static __always_inline __u32 choose(const struct stx_cfg *c, __u32 h1, __u32 *reason)
{
	__u32 n = c->n, zero = 0;
	__u32 idx = scale(h1, n);
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
static __always_inline void steer(struct __sk_buff *skb, const struct stx_cfg *c, __u32 flow, bool udp)
{
	__u32 reason, h1, idx = pick(c, flow, skb->ifindex, skb->len, udp, &reason, &h1);
	// A light flow gets hash 0, which RPS takes for none: the next device
	// processes it at once on this CPU, without a backlog pass.
	__u32 hash = reason == STX_LIGHT ? 0 : hash_for_index(idx, c->n, h1);
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
		return TC_ACT_UNSPEC;
	bool udp = false;
	__u32 flow, r = flow_at(skb, off, c->seed, &flow, &udp);
	if (r == STX_FRAGMENT)
		bump(&stx_stats, r);
	else if (r != STX_FIRST) {
		bump(&stx_stats, r);
		return TC_ACT_UNSPEC;
	}
	// A fragmented datagram's pieces stay together.
	steer(skb, c, flow, udp && r != STX_FRAGMENT);
	return TC_ACT_UNSPEC;
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
		return TC_ACT_UNSPEC;
	}
	__u32 off = sizeof(eth) + ip.ihl * 4;
	if (bpf_skb_load_bytes(skb, off, &udp, sizeof(udp)) || udp.dest != cfg_vxlan_port ||
	    bpf_skb_load_bytes(skb, off + sizeof(udp), vx, sizeof(vx)) || !(vx[0] & bpf_htonl(0x08000000)) ||
	    bpf_ntohl(vx[1]) >> 8 != cfg_vni) {
		bump(&stx_stats, STX_NOT_VXLAN);
		return TC_ACT_UNSPEC;
	}
	bump(&stx_stages, STX_STAGE_UNDERLAY);
	return steer_frame(skb, off + sizeof(udp) + VXLAN_HLEN);
}

SEC("tc")
int stx_vxlan(struct __sk_buff *skb)
{
	bump(&stx_stages, STX_STAGE_VXLAN);
	return TC_ACT_UNSPEC;
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
	return TC_ACT_UNSPEC;
}
