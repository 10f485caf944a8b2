/* broker.h - the broker's state, which its parts share (broker.c: the
 * shim protocol, the pool, the loop; seccomp.c: the seccomp agent). */
#ifndef SKIFF_BROKER_INTERNAL_H
#define SKIFF_BROKER_INTERNAL_H
#include <poll.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "skiff_broker.h"

#define MAX_SEEN 64

/* Requests of a client held back until it reads its replies, and the
 * fewest sockets one of them asked for. */
struct held { int n, want; };

struct seccomp_agent;

/* One broker: what its command line says (parse_args), the container and
 * host it serves (open), and the state of its loop (run). */
struct broker {
	/* the command line */
	const char *name, *netns, *cidr, *ipstr, *cgroup, *stats;
	int listen_fd, control_fd;
	int pool_target;
	/* --transparent: IP_TRANSPARENT on the listeners shims send ('T'). A
	 * replaced listener then answers overlay-path SYNs the agent routes
	 * to the host stack: its replies carry the container's overlay
	 * address, which is not a host address. Clients never need it, so
	 * pooled sockets go out without. */
	int transparent;
	int refuse_privileged; /* --refuse-privileged: see privileged() */
	int keeper;            /* --keeper: every seccomp call continues */

	/* the container and the host */
	struct skiff_hello hello;         /* what every client is told first */
	uint32_t net, mask, ip;           /* cluster network, its mask, the container's IP (network order) */
	uint64_t host_netns;              /* SO_NETNS_COOKIE of the host netns */
	uint64_t container_netns;         /* and of the container's (its listener's) */
	uint64_t inflight;                /* a notification the previous broker left unanswered, or 0 */
	struct stat userns;               /* the broker's (the host's) user namespace */
	volatile uint64_t *st;            /* the stats file (skiff_broker.h), or dummy */
	uint64_t dummy[SKIFF_ST_NSLOTS];

	/* the pool of host sockets */
	int *pool, npool;
	int fill_failing;   /* socket() fails: refill on a timer, log once per streak */

	/* clients: pfd[0] is the listener, pfd[1..nclients] the clients, and
	 * held their requests, by the same index */
	struct pollfd *pfd;
	struct held *held;
	int nclients, capclients;
	int reply_bytes;    /* what one unread reply adds to SIOCOUTQ */
	int accept_paused;  /* out of fds or memory: accept on the retry timer */

	/* secure mode's watch of the container's processes */
	pid_t privileged;   /* the privileged process seen; 0: none yet */
	uint64_t scanned;   /* when the cgroup was last looked at (ms, monotonic) */
	pid_t seen[MAX_SEEN]; /* privileged in the last scan */
	int nseen;

	struct seccomp_agent *sc; /* with --control-fd: the seccomp agent */
};

/* Log lines: "skiff-broker[NAME]: ...", at most a few a second. */
void log_as(const char *name);
void logf_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#define LOG(fmt, ...) logf_(fmt, ##__VA_ARGS__)

void st_add(struct broker *b, int slot, uint64_t v);

/* A host socket from the pool (made on the spot if it is empty), or -1. */
int pool_take(struct broker *b);
/* Secure mode (--refuse-privileged): the container, or process pid, may
 * hold CAP_NET_ADMIN or CAP_SYS_ADMIN in the host's user namespace. */
int broker_privileged(struct broker *b, pid_t pid);
/* Whether the int option (level, name) of fd reads want. */
int sockopt_is(int fd, int level, int name, int want);
/* IP_TRANSPARENT on a bound host listener; 0 or an errno. */
int make_transparent(struct broker *b, int fd);

/* seccomp.c: serves the container's seccomp notifications (connect and
 * listen: docs/sockets.md, "Unmodified images"); listeners arrive on the
 * control socket skiffd holds the other end of. */
int sc_setup(struct broker *b, int ctl); /* 0, or -1 (logged) */
int sc_epoll(struct broker *b);          /* what to poll: the control socket and the listeners */
void sc_ready(struct broker *b);         /* serves what is ready; never blocks */
int sc_listeners(struct broker *b);      /* listeners held */
#endif
