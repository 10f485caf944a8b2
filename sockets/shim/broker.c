/* skiff-broker: per-container host-netns TCP socket factory for libskiff.so.
 *
 * Listens on the abstract AF_UNIX SEQPACKET address "\0skiff-broker" inside the
 * container's netns, but creates every TCP socket in the host netns (and, with
 * --cgroup, in the container's cgroup so the eBPF cgroup hooks apply to them).
 * skiffd binds that address itself, before the container runs, and passes the
 * listener (--listen-fd): the name is then never free for a process of the
 * container to take.  With --netns the broker binds it (tests, manual use).
 * Protocol and stats layout: skiff_broker.h.  Single-threaded ppoll() loop.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "skiff_broker.h"
#include "broker.h"

#define MAX_POOL 4096
#define REFILL_STEP 4   /* sockets created between polls while the pool is short */
/* What one container can hold of the host's sockets without using them:
 * sockets in flight in replies it has not read are alive, and count against
 * no limit of its own. The shim asks ahead at most once and asks for at most
 * 32, so a client gets at most 2 unread replies of 32 (more requests wait
 * until it reads), and a container at most 1024 clients. */
#define MAX_CLIENTS 1024
#define MAX_REPLY   32
#define MAX_UNREAD  2
#define LOG_LINES_PER_MIN 120

const char *g_name = SKIFF_BROKER_NAME;
static volatile sig_atomic_t g_stop;
static uint64_t g_dummy_stats[SKIFF_ST_NSLOTS];
volatile uint64_t *g_st = g_dummy_stats;

static int *g_pool, g_npool, g_pool_target = 64;
/* --transparent: IP_TRANSPARENT on the listeners shims send ('T'). A replaced
 * listener then answers overlay-path SYNs the agent routes to the host stack:
 * its replies carry the container's overlay address, which is not a host
 * address. Clients never need it, so pooled sockets go out without. */
static int g_transparent;
uint64_t g_host_netns, g_container_netns, g_inflight;
uint32_t g_net, g_mask, g_ip;

static struct pollfd *g_pfd;   /* [0] = listener, [1..] clients */
static int g_nclients, g_capclients;
/* per client slot, as g_pfd: requests held back until it reads its replies,
 * and the fewest sockets one of them asked for */
struct held { int n, want; };
static struct held *g_held;
static int g_reply_bytes = 1024;   /* what one unread reply adds to SIOCOUTQ */

void logf_(const char *fmt, ...)
{
	/* a client can cause lines (fallback events, bad messages): at most
	 * LOG_LINES_PER_MIN a minute reach the log, then a count of the rest */
	static time_t minute;
	static int lines, dropped;
	time_t now = time(NULL) / 60;
	if (now != minute) {
		if (dropped) {
			char d[96];
			int n = snprintf(d, sizeof d, "skiff-broker[%s]: %d log lines suppressed\n", g_name, dropped);
			ssize_t w = write(2, d, n);
			(void)w;
		}
		minute = now;
		lines = dropped = 0;
	}
	if (++lines > LOG_LINES_PER_MIN) {
		dropped++;
		return;
	}
	char buf[512];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
	va_end(ap);
	if (n < 0) return;
	if (n > (int)sizeof buf - 2) n = sizeof buf - 2;
	buf[n++] = '\n';
	/* one write per line so concurrent brokers' lines do not interleave */
	ssize_t w = write(2, buf, n);
	(void)w;
}

static void die_usage(const char *msg) __attribute__((noreturn));
static void die_usage(const char *msg)
{
	fprintf(stderr, "skiff-broker: %s\n"
		"usage: skiff-broker {--netns PATH | --listen-fd N} --cidr NET/LEN --ip IP [--cgroup DIR] "
		"[--stats FILE] [--pool N] [--name NAME] [--transparent] [--refuse-privileged] [--control-fd N]\n"
		"       skiff-broker --keeper --control-fd N\n", msg);
	exit(2);
}

void st_add(int slot, uint64_t v) { g_st[slot] = g_st[slot] + v; }

static void on_signal(int sig) { (void)sig; g_stop = 1; }

static int g_fill_failing;   /* socket() fails: refill on a timer, log once per streak */

/* Creates up to limit sockets, short of target. */
static void pool_fill(int target, int limit)
{
	for (int made = 0; g_npool < target && made < limit; made++) {
		int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (s < 0) {
			st_add(SKIFF_ST_ERRORS, 1);
			if (!g_fill_failing)
				LOG("socket: %s (pool %d/%d)", strerror(errno), g_npool, g_pool_target);
			g_fill_failing = 1;
			return;
		}
		g_fill_failing = 0;
		g_pool[g_npool++] = s;
	}
}

int pool_take(void)
{
	if (!g_npool)
		pool_fill(1, 1);
	return g_npool ? g_pool[--g_npool] : -1;
}

/* --refuse-privileged: a host socket answers ioctls and options in the
 * host's namespace, and the kernel judges them by the caller's capabilities
 * in the host's user namespace. A container whose processes may hold
 * CAP_NET_ADMIN there (Kubernetes' "NET_ADMIN" without a user namespace)
 * could change the host's interfaces through one (SIOCSIFMTU, SIOCSIFFLAGS),
 * CAP_SYS_ADMIN likewise. Such a container gets no host sockets, for good.
 * The broker looks at each client (SO_PEERCRED) when it connects, and every
 * second at every process of the container's cgroup, so that a privileged
 * process cannot have an unprivileged one fetch sockets for it. A process of
 * the cgroup counts when it is seen privileged in two scans in a row (at
 * least a second apart): a
 * runtime joins its helper to the cgroup before the helper drops its
 * capabilities and becomes the container's process (runc init, runc exec;
 * the lab's `sh` and `ip netns exec`), which takes milliseconds. */
static int g_refuse_privileged;
static const char *g_cgroup;
static struct stat g_userns;   /* the broker's (the host's) user namespace */
static pid_t g_privileged;     /* the privileged process seen; 0: none yet */
static uint64_t g_scanned;     /* when the cgroup was last looked at (ms, monotonic) */
#define MAX_SEEN 64
static pid_t g_seen[MAX_SEEN];  /* privileged in the last scan */
static int g_nseen;

static uint64_t mono_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

#define CAP_NET_ADMIN_BIT 12
#define CAP_SYS_ADMIN_BIT 21

/* Whether a /proc status file shows CAP_NET_ADMIN or CAP_SYS_ADMIN in any
 * capability set: effective, permitted, inheritable, ambient or bounding
 * (1), or not (0). The bounding set alone is not enough: a process may drop
 * a capability from it (PR_CAPBSET_DROP, with CAP_SETPCAP, which runtimes
 * grant) and keep it permitted and effective. A file that lacks one of the
 * five sets counts as privileged; one that cannot be opened (the thread
 * has gone) is -1. */
static int status_privileged(const char *path)
{
	FILE *f = fopen(path, "re");
	if (!f)
		return -1;
	char line[256];
	unsigned long long all = 0, v;
	int sets = 0;
	while (fgets(line, sizeof line, f)) {
		char name[8];
		if (sscanf(line, "Cap%3[a-zA-Z]: %llx", name, &v) == 2) {
			all |= v;
			sets++;
		}
	}
	fclose(f);
	if (sets < 5)
		return 1;
	return (all & (1ull << CAP_NET_ADMIN_BIT | 1ull << CAP_SYS_ADMIN_BIT)) != 0;
}

/* Whether pid lives in the host's user namespace with CAP_NET_ADMIN or
 * CAP_SYS_ADMIN in any capability set of any of its threads (threads hold
 * their own sets: capset(2) is per thread). A process that has gone is
 * not. */
static int privileged(pid_t pid)
{
	char path[96];
	struct stat st;
	snprintf(path, sizeof path, "/proc/%d/ns/user", (int)pid);
	if (pid <= 0 || pid == getpid() || stat(path, &st) < 0 || st.st_dev != g_userns.st_dev ||
	    st.st_ino != g_userns.st_ino)
		return 0;
	snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
	DIR *d = opendir(path);
	if (!d) {
		snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
		return status_privileged(path) == 1;
	}
	int priv = 0;
	for (struct dirent *e; !priv && (e = readdir(d));) {
		if (e->d_name[0] < '0' || e->d_name[0] > '9')
			continue;
		snprintf(path, sizeof path, "/proc/%d/task/%.16s/status", (int)pid, e->d_name);
		priv = status_privileged(path) == 1; /* a thread gone (-1) is not */
	}
	closedir(d);
	return priv;
}

/* Adds the privileged processes of cgroup dir and the cgroups below it to
 * seen (at most MAX_SEEN); returns one that was also in the last scan's
 * g_seen, or 0. */
static pid_t privileged_in(const char *dir, int depth, pid_t *seen, int *nseen)
{
	char path[4096];
	snprintf(path, sizeof path, "%s/cgroup.procs", dir);
	FILE *f = fopen(path, "re");
	pid_t again = 0;
	if (f) {
		int pid;
		while (!again && fscanf(f, "%d", &pid) == 1) {
			if (!privileged(pid))
				continue;
			for (int i = 0; i < g_nseen; i++)
				if (g_seen[i] == pid)
					again = pid;
			if (*nseen < MAX_SEEN)
				seen[(*nseen)++] = pid;
		}
		fclose(f);
	}
	DIR *d = again || depth >= 8 ? NULL : opendir(dir);
	for (struct dirent *e; d && !again && (e = readdir(d));) {
		if (e->d_type != DT_DIR || !strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
			continue;
		snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
		again = privileged_in(path, depth + 1, seen, nseen);
	}
	if (d)
		closedir(d);
	return again;
}

int sc_privileged(pid_t pid)
{
	return g_refuse_privileged && (g_privileged || privileged(pid));
}

static void drop_client(int i, const char *why);

/* Looks at a new client (its fd; -1: none) or, once a second, at the
 * container's cgroup; once a privileged process is found, drops every
 * client: their shims fall back to the container's own sockets. Returns
 * whether the container is refused. */
static int refused(int client)
{
	if (!g_refuse_privileged || g_privileged)
		return g_privileged != 0;
	pid_t p = 0;
	if (client >= 0) {
		struct ucred uc;
		socklen_t ul = sizeof uc;
		if (getsockopt(client, SOL_SOCKET, SO_PEERCRED, &uc, &ul) == 0 && privileged(uc.pid))
			p = uc.pid;
	} else if (g_cgroup) {
		pid_t seen[MAX_SEEN];
		int nseen = 0;
		p = privileged_in(g_cgroup, 0, seen, &nseen);
		memcpy(g_seen, seen, nseen * sizeof *seen);
		g_nseen = nseen;
		g_scanned = mono_ms();
	}
	if (!p)
		return 0;
	g_privileged = p;
	g_st[SKIFF_ST_PRIVILEGED] = (uint64_t)p;
	LOG("process %d holds CAP_NET_ADMIN or CAP_SYS_ADMIN in the host's user namespace: "
	    "no host sockets for this container; it uses the overlay", (int)p);
	while (g_nclients)
		drop_client(g_nclients, "container privileged");
	return 1;
}

static void drop_client(int i, const char *why)
{
	LOG("client fd %d closed (%s), %d left", g_pfd[i].fd, why, g_nclients - 1);
	close(g_pfd[i].fd);
	g_pfd[i] = g_pfd[g_nclients];   /* last client moves into slot i */
	g_held[i] = g_held[g_nclients];
	g_nclients--;
	g_st[SKIFF_ST_CLIENTS_NOW] = (uint64_t)g_nclients;
}

/* Sends up to want sockets in one message (fewer, down to none, if the pool
 * cannot cover them). Returns 0 if sent, 1 if the client has gone (its last
 * messages, such as an exit flush, are still to be read), -1 if it must be
 * dropped. */
static int send_sockets(int c, int want)
{
	int have = want < g_npool ? want : g_npool, *fds = &g_pool[g_npool - have];
	struct skiff_reply rep = { .n = (uint32_t)have };
	struct iovec iov = { &rep, sizeof rep };
	union skiff_fds_cmsg u;
	struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1 };
	if (have)
		skiff_attach_fds(&m, &u, fds, have);
	/* A well-behaved shim asks for no more than it reads, so its receive
	 * queue stays short; a client that does not read gets dropped instead of
	 * blocking the loop. */
	ssize_t r;
	do r = sendmsg(c, &m, MSG_DONTWAIT | MSG_NOSIGNAL); while (r < 0 && errno == EINTR);
	int err = r < 0 ? errno : 0;
	/* in flight, the sockets hold their own references: the broker's go */
	skiff_close_fds(fds, have);
	g_npool -= have;
	if (r == (ssize_t)sizeof rep) {
		st_add(SKIFF_ST_HANDED_OUT, (uint64_t)have);
		return 0;
	}
	if (err == EPIPE || err == ECONNRESET)
		return 1;   /* it exited with a request outstanding */
	st_add(SKIFF_ST_ERRORS, 1);
	LOG("sendmsg to fd %d: %s", c, r < 0 ? strerror(err) : "short");
	return -1;
}

/* Replies c has not read yet (the hello and 'T' answers count too). */
static int unread(int c)
{
	int q;
	if (ioctl(c, SIOCOUTQ, &q) < 0)
		return MAX_UNREAD;
	return (q + g_reply_bytes - 1) / g_reply_bytes;
}

/* Sends client i the replies it is owed, as far as it has read the earlier
 * ones. Returns as send_sockets. */
static int serve_held(int i)
{
	while (g_held[i].n > 0 && unread(g_pfd[i].fd) < MAX_UNREAD) {
		int want = g_held[i].want;
		if (g_npool < want)   /* pool short (burst or small --pool): top up on the spot */
			pool_fill(want, MAX_POOL);
		g_held[i].n--;
		int r = send_sockets(g_pfd[i].fd, want);
		if (r) {
			g_held[i].n = 0;   /* gone, or to be dropped */
			return r;
		}
	}
	return 0;
}

/* What one reply adds to SIOCOUTQ until it is read (its buffer's true
 * size), measured on a socket pair. */
static int measure_reply_bytes(void)
{
	int sv[2], q = 0, fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	if (fd < 0 || socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) {
		if (fd >= 0) close(fd);
		return 0;
	}
	struct skiff_reply rep = { .n = 1 };
	struct iovec iov = { &rep, sizeof rep };
	union skiff_fds_cmsg u;
	struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1 };
	skiff_attach_fds(&m, &u, &fd, 1);
	if (sendmsg(sv[0], &m, MSG_DONTWAIT) != (ssize_t)sizeof rep || ioctl(sv[0], SIOCOUTQ, &q) < 0)
		q = 0;
	close(sv[0]);
	close(sv[1]);
	close(fd);
	return q;
}

int sockopt_is(int fd, int level, int name, int want)
{
	int v;
	socklen_t l = sizeof v;
	return getsockopt(fd, level, name, &v, &l) == 0 && v == want;
}

/* 'T': IP_TRANSPARENT on the shim's listener, if it is a host TCP socket
 * (one the broker handed out: the container has no other). Returns 0 or an
 * errno. */
int make_transparent(int fd)
{
	uint64_t ns = 0;
	socklen_t l = sizeof ns;
	int one = 1;
	if (!g_transparent)
		return EPERM;
	if (!sockopt_is(fd, SOL_SOCKET, SO_DOMAIN, AF_INET) || !sockopt_is(fd, SOL_SOCKET, SO_TYPE, SOCK_STREAM) ||
	    !sockopt_is(fd, SOL_SOCKET, SO_PROTOCOL, IPPROTO_TCP) ||
	    getsockopt(fd, SOL_SOCKET, SO_NETNS_COOKIE, &ns, &l) < 0 || ns != g_host_netns)
		return EINVAL;
	/* only a bound socket about to listen (the shim binds first): the
	 * broker's close of a connected socket with SO_LINGER could block it */
	struct tcp_info ti;
	struct sockaddr_in a;
	socklen_t tl = sizeof ti, al = sizeof a;
	if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &tl) < 0 || ti.tcpi_state != TCP_CLOSE ||
	    getsockname(fd, (struct sockaddr *)&a, &al) < 0 || a.sin_port == 0)
		return EINVAL;
	return setsockopt(fd, SOL_IP, IP_TRANSPARENT, &one, sizeof one) < 0 ? errno : 0;
}

static const char *reason_name(unsigned r)
{
	static const char *names[] = { "flush", "unavailable", "dest", "connect", "bind", "listen", "sockopt" };
	return r < SKIFF_R_MAX ? names[r] : "?";
}

/* The listener skiffd passed: a listening AF_UNIX SEQPACKET socket (where it
 * is bound is skiffd's business). Returns 0 or an errno. */
static int adopt_listener(int fd)
{
	int fl = fcntl(fd, F_GETFL);
	if (fl < 0)
		return errno;
	if (!sockopt_is(fd, SOL_SOCKET, SO_DOMAIN, AF_UNIX) || !sockopt_is(fd, SOL_SOCKET, SO_TYPE, SOCK_SEQPACKET) ||
	    !sockopt_is(fd, SOL_SOCKET, SO_ACCEPTCONN, 1))
		return ENOTSOCK;
	/* its file is shared with skiffd's descriptor, which never accepts */
	if (fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0 || fcntl(fd, F_SETFD, FD_CLOEXEC) < 0)
		return errno;
	return 0;
}

/* returns 0 if client i stays, -1 if it must be dropped */
static int handle_client(int i)
{
	int c = g_pfd[i].fd;
	int gone = 0;
	for (int k = 0; k < 32; k++) {   /* bounded so one client cannot starve others */
		struct skiff_msg m;
		struct iovec iov = { &m, sizeof m };
		union skiff_fds_cmsg u;
		struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
		skiff_expect_fds(&mh, &u, 1);
		ssize_t r = recvmsg(c, &mh, MSG_DONTWAIT | MSG_TRUNC | MSG_CMSG_CLOEXEC);
		int fd = -1;
		if (r >= 0) {
			int nfd = skiff_received_fds(&mh, &fd, 1);
			if ((mh.msg_flags & MSG_CTRUNC) || nfd != (r == (ssize_t)sizeof m && m.op == SKIFF_OP_TRANSPARENT)) {
				if (fd >= 0) close(fd);
				st_add(SKIFF_ST_ERRORS, 1);
				LOG("fd %d: fds where none belong", c);
				return -1;
			}
		}
		if (r < 0 && errno == ECONNRESET) {
			/* it closed with sockets still queued; its last messages
			 * (the exit flush) follow */
			gone = 1;
			continue;
		}
		if (r < 0)
			return (errno == EAGAIN || errno == EINTR) ? 0 : -1;
		if (r == 0)
			return -1;
		if (r != (ssize_t)sizeof m) {
			st_add(SKIFF_ST_ERRORS, 1);
			LOG("fd %d: bad message size %zd", c, r);
			return -1;
		}
		st_add(SKIFF_ST_REPLACED, m.replaced);
		st_add(SKIFF_ST_FALLBACK, m.fallback);
		if (m.op == SKIFF_OP_SOCKETS) {
			int want = m.arg;
			if (want < 1 || want > SKIFF_MAX_BATCH) {
				st_add(SKIFF_ST_ERRORS, 1);
				LOG("fd %d: bad count %d", c, want);
				return -1;
			}
			if (gone)
				continue;
			if (want > MAX_REPLY)
				want = MAX_REPLY;   /* a reply may carry fewer than asked */
			if (!g_held[i].n || want < g_held[i].want)
				g_held[i].want = want;
			g_held[i].n++;
			if ((gone = serve_held(i)) < 0)
				return -1;
		} else if (m.op == SKIFF_OP_TRANSPARENT) {
			int err = make_transparent(fd);
			close(fd);
			if (err)
				LOG("fd %d: listener not made transparent: %s", c, strerror(err));
			struct skiff_reply rep = { .n = !err };
			if (!gone && send(c, &rep, sizeof rep, MSG_DONTWAIT | MSG_NOSIGNAL) != (ssize_t)sizeof rep)
				gone = 1;
		} else if (m.op == SKIFF_OP_FLUSH) {
			if (m.arg != SKIFF_R_FLUSH)
				LOG("fd %d: fallback event reason=%s (+%u replaced +%u fallback)",
				    c, reason_name(m.arg), m.replaced, m.fallback);
		} else {
			st_add(SKIFF_ST_ERRORS, 1);
			LOG("fd %d: unknown op 0x%02x", c, m.op);
			return -1;
		}
	}
	return 0;
}

static int g_accept_paused;   /* out of fds or memory: accept on the retry timer */

static void accept_clients(int ls, const struct skiff_hello *hello)
{
	for (;;) {
		int c = accept4(ls, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (c < 0) {
			if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
				/* the connection stays queued and the listener readable:
				 * polling it now would spin */
				if (!g_accept_paused)
					LOG("accept: %s (%d clients); retrying every 100 ms", strerror(errno), g_nclients);
				st_add(SKIFF_ST_ERRORS, !g_accept_paused);
				g_accept_paused = 1;
				g_pfd[0].events = 0;
			} else if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
				st_add(SKIFF_ST_ERRORS, 1);
				LOG("accept: %s", strerror(errno));
			}
			return;
		}
		g_accept_paused = 0;
		if (refused(c)) {   /* the shim falls back */
			st_add(SKIFF_ST_ERRORS, 1);
			close(c);
			continue;
		}
		if (g_nclients >= MAX_CLIENTS) {   /* the shim falls back */
			st_add(SKIFF_ST_ERRORS, 1);
			LOG("client refused: %d clients already", g_nclients);
			close(c);
			continue;
		}
		if (send(c, hello, sizeof *hello, MSG_DONTWAIT | MSG_NOSIGNAL) != (ssize_t)sizeof *hello) {
			st_add(SKIFF_ST_ERRORS, 1);
			close(c);
			continue;
		}
		if (g_nclients + 2 >= g_capclients) {   /* + the client, + the seccomp agent's slot */
			int cap = g_capclients ? g_capclients * 2 : 64;
			struct pollfd *p = realloc(g_pfd, cap * sizeof *p);
			if (p) g_pfd = p;
			struct held *h = p ? realloc(g_held, cap * sizeof *h) : NULL;
			if (h) g_held = h;
			if (!h) { st_add(SKIFF_ST_ERRORS, 1); close(c); continue; }
			g_capclients = cap;
		}
		g_nclients++;
		g_pfd[g_nclients].fd = c;
		g_pfd[g_nclients].events = POLLIN;
		g_pfd[g_nclients].revents = 0;
		g_held[g_nclients].n = 0;
		st_add(SKIFF_ST_CLIENTS_TOTAL, 1);
		g_st[SKIFF_ST_CLIENTS_NOW] = (uint64_t)g_nclients;
		LOG("client fd %d connected, %d open", c, g_nclients);
	}
}

static int parse_ip(const char *s, uint32_t *out)
{
	struct in_addr a;
	if (inet_pton(AF_INET, s, &a) != 1) return -1;
	*out = a.s_addr;
	return 0;
}

/* Raises the soft descriptor limit to the hard one. */
static void raise_nofile(void)
{
	struct rlimit rl;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
			LOG("raise RLIMIT_NOFILE: %s", strerror(errno));
	}
}

/* SIGTERM and SIGINT end the loop: blocked but while in ppoll (with
 * *empty, the mask it waits with), so none falls between a check of
 * g_stop and the wait. */
static void stop_on_signals(sigset_t *empty)
{
	sigset_t block;
	sigemptyset(&block); sigaddset(&block, SIGTERM); sigaddset(&block, SIGINT);
	sigemptyset(empty);
	sigprocmask(SIG_BLOCK, &block, NULL);
	struct sigaction sact = { .sa_handler = on_signal };
	sigaction(SIGTERM, &sact, NULL);
	sigaction(SIGINT, &sact, NULL);
}

int g_keeper;

/* --keeper: holds the seccomp listeners of processes that get no host
 * sockets (no container of the host, or none the layer replaces) and
 * continues every call of theirs, so that they outlive skiffd: with no
 * holder left the kernel would fail them (ENOSYS). One per host. */
static int keep(int control_fd)
{
	g_name = "keeper";
	if (fcntl(control_fd, F_SETFD, FD_CLOEXEC) < 0 || sc_setup(control_fd) < 0)
		return 1;
	raise_nofile();   /* a listener per process of every container without host sockets */
	sigset_t empty;
	stop_on_signals(&empty);
	LOG("ready pid %d", (int)getpid());
	struct pollfd p = { .fd = sc_epoll(), .events = POLLIN };
	while (!g_stop) {
		if (ppoll(&p, 1, NULL, &empty) < 0 && errno != EINTR) {
			LOG("ppoll: %s", strerror(errno));
			return 1;
		}
		if (p.revents)
			sc_ready();
	}
	LOG("exiting (signal), %d listeners", sc_listeners());
	return 0;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "netns", required_argument, 0, 'n' }, { "cidr", required_argument, 0, 'c' },
		{ "ip", required_argument, 0, 'i' }, { "cgroup", required_argument, 0, 'g' },
		{ "stats", required_argument, 0, 's' }, { "pool", required_argument, 0, 'p' },
		{ "name", required_argument, 0, 'N' }, { "transparent", no_argument, 0, 'T' },
		{ "listen-fd", required_argument, 0, 'L' }, { "refuse-privileged", no_argument, 0, 'P' },
		{ "control-fd", required_argument, 0, 'C' }, { "keeper", no_argument, 0, 'K' },
		{ "help", no_argument, 0, 'h' }, { 0, 0, 0, 0 } };
	const char *netns = NULL, *cidr = NULL, *ipstr = NULL, *cgroup = NULL, *stats = NULL;
	int listen_fd = -1, control_fd = -1;
	char msg[600];
	int o;
	opterr = 0;
	while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (o) {
		case 'n': netns = optarg; break;
		case 'c': cidr = optarg; break;
		case 'i': ipstr = optarg; break;
		case 'g': cgroup = optarg; break;
		case 's': stats = optarg; break;
		case 'N': g_name = optarg; break;
		case 'T': g_transparent = 1; break;
		case 'P': g_refuse_privileged = 1; break;
		case 'K': g_keeper = 1; break;
		case 'L': {
			char *e; long v = strtol(optarg, &e, 10);
			if (*e || e == optarg || v < 3 || v > 1023) die_usage("bad --listen-fd (3..1023)");
			listen_fd = (int)v;
			break;
		}
		case 'C': {
			char *e; long v = strtol(optarg, &e, 10);
			if (*e || e == optarg || v < 3 || v > 1023) die_usage("bad --control-fd (3..1023)");
			control_fd = (int)v;
			break;
		}
		case 'p': {
			char *e; long v = strtol(optarg, &e, 10);
			if (*e || e == optarg || v < 0 || v > MAX_POOL) die_usage("bad --pool (0..4096)");
			g_pool_target = (int)v;
			break;
		}
		case 'h': die_usage("help");
		case ':':
			snprintf(msg, sizeof msg, "flag %s needs a value", argv[optind - 1]);
			die_usage(msg);
		default:
			snprintf(msg, sizeof msg, "unknown flag %s", argv[optind - 1]);
			die_usage(msg);
		}
	}
	if (optind < argc) { snprintf(msg, sizeof msg, "unexpected argument %s", argv[optind]); die_usage(msg); }
	if (g_keeper) {
		if (control_fd < 0) die_usage("--keeper needs --control-fd");
		return keep(control_fd);
	}
	if (!netns == (listen_fd < 0)) die_usage("want one of --netns and --listen-fd");
	if (!cidr) die_usage("missing --cidr");
	if (!ipstr) die_usage("missing --ip");
	if (!*g_name || strlen(g_name) > sizeof(((struct sockaddr_un *)0)->sun_path) - 2)
		die_usage("bad --name");

	struct skiff_hello hello = { .magic = SKIFF_HELLO_MAGIC, .version = SKIFF_PROTO_VERSION };
	{
		char buf[64];
		const char *sl = strchr(cidr, '/');
		char *e;
		if (!sl || sl - cidr >= (long)sizeof buf) die_usage("bad --cidr (want A.B.C.D/LEN)");
		memcpy(buf, cidr, sl - cidr); buf[sl - cidr] = 0;
		long len = strtol(sl + 1, &e, 10);
		if (*e || e == sl + 1 || len < 0 || len > 32 || parse_ip(buf, &hello.net))
			die_usage("bad --cidr (want A.B.C.D/LEN)");
		uint32_t mask = len ? htonl(~0u << (32 - len)) : 0;
		if (hello.net & ~mask) die_usage("bad --cidr: host bits set");
		hello.prefix = (uint8_t)len;
		if (parse_ip(ipstr, &hello.ip)) die_usage("bad --ip");
		if ((hello.ip & mask) != hello.net) die_usage("--ip is not inside --cidr");
		g_net = hello.net;
		g_mask = mask;
		g_ip = hello.ip;
	}

	int nsfd = -1, hostfd = -1;
	if (netns) {
		nsfd = open(netns, O_RDONLY | O_CLOEXEC);
		if (nsfd < 0) { fprintf(stderr, "skiff-broker: open netns %s: %s\n", netns, strerror(errno)); return 1; }
		hostfd = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
		if (hostfd < 0) { fprintf(stderr, "skiff-broker: open /proc/self/ns/net: %s\n", strerror(errno)); return 1; }
	}

	if (g_refuse_privileged && stat("/proc/self/ns/user", &g_userns) < 0) {
		fprintf(stderr, "skiff-broker: /proc/self/ns/user: %s\n", strerror(errno));
		return 1;
	}
	g_cgroup = cgroup;
	if (cgroup) {
		char path[4096];
		snprintf(path, sizeof path, "%s/cgroup.procs", cgroup);
		int fd = open(path, O_WRONLY | O_CLOEXEC);
		if (fd < 0 || write(fd, "0", 1) != 1) {
			fprintf(stderr, "skiff-broker: join cgroup %s: %s\n", cgroup, strerror(errno));
			return 1;
		}
		close(fd);
	}

	if (stats) {
		/* a notification the broker before this one had taken and not
		 * answered when it died: its caller waits until someone does */
		int old = open(stats, O_RDONLY | O_CLOEXEC);
		uint64_t prev[SKIFF_ST_NSLOTS] = { 0 };
		if (old >= 0) {
			if (read(old, prev, sizeof prev) == (ssize_t)sizeof prev && prev[SKIFF_ST_MAGIC] == SKIFF_STATS_MAGIC)
				g_inflight = prev[SKIFF_ST_SC_INFLIGHT];
			close(old);
		}
		int fd = open(stats, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
		if (fd < 0 || ftruncate(fd, SKIFF_STATS_SIZE) < 0) {
			fprintf(stderr, "skiff-broker: stats %s: %s\n", stats, strerror(errno));
			return 1;
		}
		void *p = mmap(NULL, SKIFF_STATS_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (p == MAP_FAILED) { fprintf(stderr, "skiff-broker: mmap %s: %s\n", stats, strerror(errno)); return 1; }
		close(fd);
		g_st = p;
	}
	g_st[SKIFF_ST_PID] = (uint64_t)getpid();

	/* the listener lives in the container netns; everything else in the host netns */
	int ls = listen_fd, lerr = 0;
	if (netns) {
		if (setns(nsfd, CLONE_NEWNET) < 0) {
			fprintf(stderr, "skiff-broker: setns %s: %s\n", netns, strerror(errno));
			return 1;
		}
		ls = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
		struct sockaddr_un sa = { .sun_family = AF_UNIX };
		size_t nl = strlen(g_name);
		memcpy(sa.sun_path + 1, g_name, nl);
		socklen_t salen = offsetof(struct sockaddr_un, sun_path) + 1 + nl;
		if (ls < 0 || bind(ls, (struct sockaddr *)&sa, salen) < 0 || listen(ls, 512) < 0)
			lerr = errno;
		if (setns(hostfd, CLONE_NEWNET) < 0) {
			fprintf(stderr, "skiff-broker: setns back to host netns: %s\n", strerror(errno));
			return 1;
		}
		close(hostfd);
		close(nsfd);
	} else {
		lerr = adopt_listener(ls);
	}
	{
		/* the shim checks a socket is one of ours before it replaces it */
		int s = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
		socklen_t l = sizeof hello.host_netns;
		if (s < 0 || getsockopt(s, SOL_SOCKET, SO_NETNS_COOKIE, &hello.host_netns, &l) < 0) {
			fprintf(stderr, "skiff-broker: netns cookie: %s\n", strerror(errno));
			return 1;
		}
		close(s);
		g_host_netns = hello.host_netns;
		/* the container's: the only sockets the seccomp agent swaps */
		l = sizeof g_container_netns;
		if (getsockopt(ls, SOL_SOCKET, SO_NETNS_COOKIE, &g_container_netns, &l) < 0)
			g_container_netns = 0;
	}
	if (lerr) {
		if (netns)
			fprintf(stderr, "skiff-broker: listen on @%s in %s: %s\n", g_name, netns, strerror(lerr));
		else
			fprintf(stderr, "skiff-broker: --listen-fd %d: %s\n", listen_fd, strerror(lerr));
		return 1;
	}

	/* one connection per process of the container, plus the pool: a
	 * container of many processes (prefork servers) needs more than the
	 * usual soft limit of 1024 */
	raise_nofile();
	g_pool = calloc(MAX_POOL, sizeof(int));
	g_capclients = 64;
	g_pfd = calloc(g_capclients, sizeof *g_pfd);
	g_held = calloc(g_capclients, sizeof *g_held);
	if (!g_pool || !g_pfd || !g_held) { fprintf(stderr, "skiff-broker: out of memory\n"); return 1; }
	int rb = measure_reply_bytes();
	if (rb > 0)
		g_reply_bytes = rb;
	g_pfd[0].fd = ls;
	g_pfd[0].events = POLLIN;
	/* the seccomp agent's: control socket and listeners behind one epoll,
	 * polled after the clients */
	if (control_fd >= 0 && (fcntl(control_fd, F_SETFD, FD_CLOEXEC) < 0 || sc_setup(control_fd) < 0))
		return 1;

	sigset_t empty;
	stop_on_signals(&empty);
	signal(SIGPIPE, SIG_IGN);
	/* written after everything is set up (listener bound, stats mapped): readers
	 * may treat a valid magic as "broker ready" */
	g_st[SKIFF_ST_MAGIC] = SKIFF_STATS_MAGIC;

	/* Refilling is background work: as SCHED_BATCH the broker's wake-up
	 * (a shim asking for its next batch) does not preempt the application
	 * that asked, which still has sockets in hand. */
	struct sched_param sp = { 0 };
	int batch = sched_setscheduler(0, SCHED_BATCH, &sp) == 0;
	if (!batch)
		LOG("SCHED_BATCH: %s", strerror(errno));
	pool_fill(g_pool_target, MAX_POOL);
	{
		char nb[INET_ADDRSTRLEN], ib[INET_ADDRSTRLEN];
		inet_ntop(AF_INET, &hello.net, nb, sizeof nb);
		inet_ntop(AF_INET, &hello.ip, ib, sizeof ib);
		LOG("ready pid %d netns %s cidr %s/%u ip %s pool %d%s%s", (int)getpid(), netns ? netns : "of --listen-fd", nb,
		    hello.prefix, ib, g_npool, cgroup ? " cgroup " : "", cgroup ? cgroup : "");
	}

	while (!g_stop) {
		/* while the pool is short, poll without waiting: it refills a few
		 * sockets at a time between polls (every 100 ms while socket() fails) */
		static const struct timespec now = { 0, 0 }, retry = { 0, 100 * 1000 * 1000 };
		static const struct timespec held = { 0, 5 * 1000 * 1000 };
		const struct timespec *wait = g_npool >= g_pool_target ? NULL : g_fill_failing ? &retry : &now;
		if (g_accept_paused && !wait)
			wait = &retry;
		static const struct timespec second = { 1, 0 };
		int watching = g_refuse_privileged && !g_privileged && g_cgroup;
		if (watching && !wait)
			wait = &second;
		/* replies held back: look again soon whether their clients read */
		for (int i = 1; i <= g_nclients && wait != &now; i++)
			if (g_held[i].n) { wait = &held; break; }
		/* a notification's target waits until the broker answers: it
		 * must wake the broker at once, which SCHED_BATCH does not */
		if (batch && control_fd >= 0 && sc_listeners() > 0)
			batch = sched_setscheduler(0, SCHED_OTHER, &sp) < 0;
		int npfd = 1 + g_nclients;
		if (control_fd >= 0) {
			g_pfd[npfd].fd = sc_epoll();
			g_pfd[npfd].events = POLLIN;
			g_pfd[npfd++].revents = 0;
		}
		int r = ppoll(g_pfd, npfd, wait, &empty);
		if (r < 0) {
			if (errno == EINTR) continue;
			LOG("ppoll: %s", strerror(errno));
			break;
		}
		if (control_fd >= 0 && g_pfd[1 + g_nclients].revents)
			sc_ready();
		if (g_accept_paused) {   /* try again after any wake-up, at the latest on the timer */
			g_pfd[0].events = POLLIN;
			g_pfd[0].revents = POLLIN;
		}
		for (int i = g_nclients; i >= 1; i--) {   /* backwards: drop_client moves the last one into i */
			short re = g_pfd[i].revents;
			if (!re) continue;
			g_pfd[i].revents = 0;
			if (re & POLLIN) {
				if (handle_client(i) < 0) { drop_client(i, "eof/error"); continue; }
			} else if (re & (POLLHUP | POLLERR | POLLNVAL)) {
				drop_client(i, "hangup");
			}
		}
		for (int i = g_nclients; i >= 1; i--)
			if (g_held[i].n && serve_held(i) < 0)
				drop_client(i, "eof/error");
		/* at least a second apart: a process privileged for less
		 * than that is seen in one scan at most */
		if (watching && mono_ms() - g_scanned >= 1000)
			refused(-1);
		if (g_pfd[0].revents & POLLIN)
			accept_clients(ls, &hello);
		g_pfd[0].revents = 0;
		/* Off the critical path, since replies already went out, and in
		 * steps: a burst of socket creation would hold up the connections
		 * of whoever shares this CPU. */
		if (g_npool < g_pool_target) {
			pool_fill(g_pool_target, REFILL_STEP);
			sched_yield();
		}
	}
	LOG("exiting (%s), handed out %llu", g_stop ? "signal" : "error",
	    (unsigned long long)g_st[SKIFF_ST_HANDED_OUT]);
	g_st[SKIFF_ST_CLIENTS_NOW] = 0;
	return g_stop ? 0 : 1;
}
