// The options a container's socket carries over when the seccomp agent
// swaps a host socket in for it (sockets/broker/seccomp.c): sks_setsockopt
// records, per socket, which of them the program set (bit i: the i-th
// entry), and sks_getsockopt answers the set at (SKS_OPTSET_LEVEL,
// SKS_OPTSET_NAME), so the broker reads and copies only those. Shared by
// the eBPF program and the broker: plain numbers.
#pragma once

#include "skiff_sockopt.h"

#define SKS_OPTSET_LEVEL SKIFF_SOL
#define SKS_OPTSET_NAME SKIFF_SO_OPTSET

// X(level, name, length of the value): SOL_SOCKET 1, SOL_IP 0, SOL_TCP 6.
// Only options anyone may set, whose copy the broker's privileges change
// nothing about; any other option a socket set (priority, mark, device,
// TOS, congestion control, IP options, ...) is SKS_OPTSET_OTHER, and such a
// socket stays the program's.
#define SKS_OPTSET(X)                                          \
	X(1, 2, 4)   /* SO_REUSEADDR */                            \
	X(1, 9, 4)   /* SO_KEEPALIVE */                            \
	X(1, 13, 8)  /* SO_LINGER */                               \
	X(1, 20, 16) /* SO_RCVTIMEO */                             \
	X(1, 21, 16) /* SO_SNDTIMEO */                             \
	X(1, 10, 4)  /* SO_OOBINLINE */                            \
	X(1, 8, 4)   /* SO_RCVBUF (reads back doubled) */          \
	X(1, 7, 4)   /* SO_SNDBUF (reads back doubled) */          \
	X(0, 24, 4)  /* IP_BIND_ADDRESS_NO_PORT */                 \
	X(6, 1, 4)   /* TCP_NODELAY */                             \
	X(6, 2, 4)   /* TCP_MAXSEG */                              \
	X(6, 4, 4)   /* TCP_KEEPIDLE */                            \
	X(6, 5, 4)   /* TCP_KEEPINTVL */                           \
	X(6, 6, 4)   /* TCP_KEEPCNT */                             \
	X(6, 18, 4)  /* TCP_USER_TIMEOUT */                        \
	X(6, 25, 4)  /* TCP_NOTSENT_LOWAT */

#define SKS_OPTSET_OTHER 31 // the bit of every other option
