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
//   from_underlay ingress of the underlay device: records a whole
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
//   from_overlay, from_container, to_container: overlay packets for replaced
//                 listeners go to the host stack (by their TOS, which a local
//                 route of the host matches; see route_container_packet).
//                 from_container also drops a container's TCP fragments,
//                 malformed segments and option SYNs (forged).
//   dump/destroy  iter/tcp: list replaced sockets; end the ones the agent
//                 marks (policy changes) with bpf_sock_destroy.
//
// This file is one bpf2go unit; the programs are in progs/, by hook:
// maps.h (maps, shared helpers), sock.h (the cgroup socket hooks), sockops.h,
// packet.h (the tc programs' helpers), recorder.h (from_underlay),
// lookup.h, steer.h (from_overlay, from_container, to_container), iter.h.

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
volatile const __u32 cfg_tracked_mark; // packets turned back from the bridge: conntrack saw them already
volatile const __u8 cfg_tos;           // routes them there (TOS bits of a local route)
volatile const __be32 cfg_same_host;    // both ends of a same-host fast connection (on lo)
volatile const __u32 cfg_listen_quota;  // ports a container's host sockets may hold (bound or listening)

#include "progs/maps.h"
#include "progs/sock.h"
#include "progs/sockops.h"
#include "progs/packet.h"
#include "progs/recorder.h"
#include "progs/lookup.h"
#include "progs/steer.h"
#include "progs/iter.h"
