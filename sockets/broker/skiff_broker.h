/* skiff_broker.h - wire protocol between libskiff.so (LD_PRELOAD shim, in the
 * container netns) and skiff-broker (per-container socket factory, host netns),
 * and the layout of the broker's mmap'd stats file.
 *
 * Transport: AF_UNIX SOCK_SEQPACKET, abstract address "\0" SKIFF_BROKER_NAME
 * (created inside the container's netns, so it is only visible there).
 * All structs are host-endian (both ends are on the same machine), fixed size,
 * one struct per SEQPACKET message.  IP addresses are in network byte order.
 *
 *  broker -> shim, once after accept:   struct skiff_hello          (32 bytes)
 *  shim -> broker:                      struct skiff_msg, op 'S'    (12 bytes)
 *  broker -> shim, for each 'S' n:      one struct skiff_reply (4 bytes) with
 *                                       n' <= n and n' fds in one SCM_RIGHTS
 *                                       cmsg (n' = 0, no cmsg: the broker could
 *                                       not create any)
 *  shim -> broker:                      struct skiff_msg, op 'F'    (12 bytes), no reply
 *  shim -> broker:                      struct skiff_msg, op 'T'    (12 bytes) with the
 *                                       shim's listener in an SCM_RIGHTS cmsg
 *  broker -> shim, for each 'T':        struct skiff_reply, n = 1 if the listener is
 *                                       now IP_TRANSPARENT, 0 if refused
 *
 * A batch per message: the fds land at the lowest free numbers of the shim's
 * process; the shim hands out the first (where socket()'s would land) and
 * moves the others up to its pool (>= 3/4 of min(fd limit, 1024)), from which each
 * socket() takes one with F_DUPFD to the lowest free number.  The shim sends
 * 'T' over a connection of its own (on the shared one the reply would queue
 * behind a batch).
 */
#ifndef SKIFF_BROKER_H
#define SKIFF_BROKER_H
#include <arpa/inet.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SO_BINDTOIFINDEX
#define SO_BINDTOIFINDEX 62
#endif
#ifndef SO_NETNS_COOKIE
#define SO_NETNS_COOKIE 71
#endif

#define SKIFF_BROKER_NAME     "skiff-broker"   /* abstract name, without the leading NUL */
#define SKIFF_HELLO_MAGIC     0x31464b53u      /* "SKF1" little-endian */
#define SKIFF_PROTO_VERSION   4u
#define SKIFF_MAX_BATCH       64               /* max fds per request/reply */

/* offset: 0 magic, 4 version, 8 net, 12 prefix, 13..15 pad (0), 16 ip, 20 flags, 24 host_netns */
struct skiff_hello {
	uint32_t magic;     /* SKIFF_HELLO_MAGIC */
	uint32_t version;   /* SKIFF_PROTO_VERSION */
	uint32_t net;       /* cluster network, network byte order */
	uint8_t  prefix;    /* cluster prefix length 0..32 */
	uint8_t  pad[3];
	uint32_t ip;        /* the container's overlay IP, network byte order */
	uint32_t flags;     /* reserved, 0 */
	uint64_t host_netns; /* SO_NETNS_COOKIE of the sockets handed out */
};

#define SKIFF_OP_SOCKETS 'S'   /* request sockets; reply follows */
#define SKIFF_OP_FLUSH   'F'   /* counter flush / event; no reply */
#define SKIFF_OP_TRANSPARENT 'T' /* make the passed listener IP_TRANSPARENT; reply follows */

/* offset: 0 op, 1 count|reason, 2..3 pad (0), 4 replaced, 8 fallback.
 * replaced/fallback: counts accumulated by the sender since its previous message. */
struct skiff_msg {
	uint8_t  op;
	uint8_t  arg;       /* 'S': number of sockets wanted, 1..SKIFF_MAX_BATCH; 'F': reason; 'T': 0 */
	uint16_t pad;
	uint32_t replaced;
	uint32_t fallback;
};

/* 'F' reasons */
enum skiff_reason {
	SKIFF_R_FLUSH       = 0,  /* periodic / exit flush, nothing happened */
	SKIFF_R_UNAVAILABLE = 1,  /* broker unreachable or returned no socket: real socket() used */
	SKIFF_R_DEST        = 2,  /* connect: destination not in cluster CIDR / not AF_INET */
	SKIFF_R_CONNECT     = 3,  /* connect: kernel refused the fast path (EPERM, ENETUNREACH, ...) */
	SKIFF_R_BIND        = 4,  /* bind: address not fast-path-able or refused */
	SKIFF_R_LISTEN      = 5,  /* listen: implicit bind refused, or the broker did not make it transparent */
	SKIFF_R_SOCKOPT     = 6,  /* setsockopt refused (EPERM) on the host socket */
	SKIFF_R_MAX
};

/* offset 0: n (reply to 'S': number of fds in the SCM_RIGHTS cmsg of this message, 0..the number asked;
 * reply to 'T': 1 done, 0 refused) */
struct skiff_reply {
	uint32_t n;
};

/* Stats file (--stats FILE): SKIFF_STATS_SIZE bytes, mmap'd MAP_SHARED by the
 * broker and updated in place; array of uint64_t, host-endian, 8-byte aligned.
 * Each slot is written with a single aligned 64-bit store (readers never see torn values).
 *   [0] SKIFF_STATS_MAGIC (low 32 bits "SKST", high 32 bits layout version)
 *   [1] handed_out     sockets sent to shims
 *   [2] replaced       connect/listen done on host sockets (reported by shims)
 *   [3] fallback       swaps to container sockets + "unavailable" (reported by shims)
 *   [4] clients_total  shim connections accepted
 *   [5] clients_now    shim connections open
 *   [6] errors         socket()/sendmsg/protocol errors in the broker
 *   [7] pid            broker pid
 *   [8] privileged     --refuse-privileged: the pid of the privileged process
 *                      that made the broker refuse the container, 0 if none
 * Layout v3 adds the seccomp agent's counters (seccomp.c):
 *   [9]  sc_listeners  notification listeners held now
 *   [10] sc_replaced   connect/listen swapped to host sockets
 *   [11] sc_fallback   connect/listen left to the container's socket although
 *                      in the cluster (refused, bound, option, epoll)
 *   [12] sc_passed     notifications continued untouched (not IPv4 TCP in the
 *                      cluster, or already a host socket: the shim's)
 *   [13] sc_dropped    notifications whose target went while handled
 *   [14] sc_ns         nanoseconds from receiving to answering, over
 *   [15] sc_handled    the notifications handled
 *   [16] sc_inflight   the id of the notification being handled, 0 between:
 *                      a broker started after one that died answers it
 */
#define SKIFF_STATS_MAGIC    (0x54534b53ull | (3ull << 32))   /* "SKST", layout v3 */
enum {
	SKIFF_ST_MAGIC = 0, SKIFF_ST_HANDED_OUT, SKIFF_ST_REPLACED, SKIFF_ST_FALLBACK,
	SKIFF_ST_CLIENTS_TOTAL, SKIFF_ST_CLIENTS_NOW, SKIFF_ST_ERRORS, SKIFF_ST_PID,
	SKIFF_ST_PRIVILEGED, SKIFF_ST_SC_LISTENERS, SKIFF_ST_SC_REPLACED, SKIFF_ST_SC_FALLBACK,
	SKIFF_ST_SC_PASSED, SKIFF_ST_SC_DROPPED, SKIFF_ST_SC_NS, SKIFF_ST_SC_HANDLED, SKIFF_ST_SC_INFLIGHT,
	SKIFF_ST_NSLOTS
};

/* skiffd -> broker, on the control socket (--control-fd, AF_UNIX
 * SOCK_SEQPACKET, a socket pair skiffd made): one byte SKIFF_CTL_LISTENER
 * with a container process's seccomp listener in SCM_RIGHTS. */
#define SKIFF_CTL_LISTENER 'L'

/* The bit the shim sets in connect()'s and listen()'s descriptor argument:
 * skiff's seccomp profile notifies only calls without it (the kernel reads
 * the int's low 32 bits). sockets/broker/seccomp.Tag. */
#define SKIFF_SECCOMP_TAG (1ull << 32)
#define SKIFF_STATS_SIZE     (SKIFF_ST_NSLOTS * 8)

/* Room for the fds a message carries ('S' replies, 'T' requests). */
union skiff_fds_cmsg {
	char buf[CMSG_SPACE(SKIFF_MAX_BATCH * sizeof(int))];
	struct cmsghdr align;
};

/* Attaches fds[0..n) (1 <= n <= SKIFF_MAX_BATCH) to m as its SCM_RIGHTS cmsg, in u. */
static inline void skiff_attach_fds(struct msghdr *m, union skiff_fds_cmsg *u, const int *fds, int n)
{
	m->msg_control = u->buf;
	m->msg_controllen = CMSG_SPACE(n * sizeof(int));
	struct cmsghdr *cm = CMSG_FIRSTHDR(m);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(n * sizeof(int));
	memcpy(CMSG_DATA(cm), fds, n * sizeof(int));
}

/* Prepares m to receive a message with at most max fds, into u. A sender
 * that passes more makes the kernel close the extra ones and set MSG_CTRUNC. */
static inline void skiff_expect_fds(struct msghdr *m, union skiff_fds_cmsg *u, int max)
{
	m->msg_control = u->buf;
	m->msg_controllen = CMSG_SPACE(max * sizeof(int));
}

/* Closes every fd of every SCM_RIGHTS cmsg of a received message (a raw
 * close: the shim interposes close()). */
static inline void skiff_close_received(struct msghdr *m)
{
	for (struct cmsghdr *cm = CMSG_FIRSTHDR(m); cm; cm = CMSG_NXTHDR(m, cm)) {
		if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS || cm->cmsg_len < CMSG_LEN(0))
			continue;
		size_t n = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < n; i++) {
			int fd;
			memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof fd);
			syscall(SYS_close, fd);
		}
	}
}

#ifndef SYS_close_range
#define SYS_close_range 436
#endif

/* Closes fds[0..n) (n <= SKIFF_MAX_BATCH): one close_range per run of
 * consecutive numbers, which a batch of sockets mostly is, instead of a
 * close each (a raw syscall: the shim interposes close()). */
static inline void skiff_close_fds(const int *fds, int n)
{
	int s[SKIFF_MAX_BATCH];
	for (int i = 0; i < n; i++) {   /* sorted copy (the broker's pool is in no order) */
		int j = i;
		for (; j > 0 && s[j - 1] > fds[i]; j--)
			s[j] = s[j - 1];
		s[j] = fds[i];
	}
	for (int i = 0; i < n;) {
		int j = i + 1;
		while (j < n && s[j] == s[j - 1] + 1)
			j++;
		if (j - i == 1 || syscall(SYS_close_range, s[i], s[j - 1], 0) < 0)
			for (int k = i; k < j; k++)   /* one fd, or a kernel before 5.9 */
				syscall(SYS_close, s[k]);
		i = j;
	}
}

/* The number of fds a received message carried (copied to fds, at most
 * max), or -1 if its control data is not one SCM_RIGHTS cmsg; then every
 * fd it carried is closed. */
static inline int skiff_received_fds(struct msghdr *m, int *fds, int max)
{
	struct cmsghdr *cm = CMSG_FIRSTHDR(m);
	if (!cm)
		return 0;
	if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS || cm->cmsg_len < CMSG_LEN(0))
		goto bad;
	size_t n = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
	if (n > (size_t)max || CMSG_NXTHDR(m, cm))
		goto bad;
	memcpy(fds, CMSG_DATA(cm), n * sizeof(int));
	return (int)n;
bad:
	skiff_close_received(m);
	return -1;
}

/* Whether a connection to ip (network order) may take the fast path: an
 * address of the cluster network (net/mask, network order) or loopback.
 * The shim and the broker's seccomp agent decide alike. */
static inline int skiff_fast_ip(uint32_t ip, uint32_t net, uint32_t mask)
{
	return (ip & mask) == net || (ntohl(ip) >> 24) == 127;
}

/* Whether sockops bound a listener to lo (index 1): it could not publish
 * it, so it takes nothing over the network. */
static inline int skiff_on_lo(int fd)
{
	int ifindex = 0;
	socklen_t l = sizeof ifindex;
	return getsockopt(fd, SOL_SOCKET, SO_BINDTOIFINDEX, &ifindex, &l) == 0 && ifindex == 1;
}

_Static_assert(sizeof(struct skiff_hello) == 32, "hello layout");
_Static_assert(sizeof(struct skiff_msg) == 12, "msg layout");
_Static_assert(sizeof(struct skiff_reply) == 4, "reply layout");

#endif
