//go:build ignore

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

static volatile sig_atomic_t g_stop;

/* --transparent: IP_TRANSPARENT on the listeners shims send ('T'). A replaced
 * listener then answers overlay-path SYNs the agent routes to the host stack:
 * its replies carry the container's overlay address, which is not a host
 * address. Clients never need it, so pooled sockets go out without. */

/* per client slot, as b->pfd: requests held back until it reads its replies,
 * and the fewest sockets one of them asked for */

static const char *log_name = SKIFF_BROKER_NAME;

void log_as(const char *name) { log_name = name; }

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
			int n = snprintf(d, sizeof d, "skiff-broker[%s]: %d log lines suppressed\n", log_name, dropped);
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
	int p = snprintf(buf, sizeof buf - 1, "skiff-broker[%s]: ", log_name);
	if (p < 0 || p >= (int)sizeof buf - 2)
		return;
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(buf + p, sizeof buf - 1 - p, fmt, ap);
	va_end(ap);
	if (n < 0) return;
	n += p;
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

void st_add(struct broker *b, int slot, uint64_t v) { b->st[slot] = b->st[slot] + v; }

static void on_signal(int sig) { (void)sig; g_stop = 1; }


/* Creates up to limit sockets, short of target. */
static void pool_fill(struct broker *b, int target, int limit)
{
	for (int made = 0; b->npool < target && made < limit; made++) {
		int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (s < 0) {
			st_add(b, SKIFF_ST_ERRORS, 1);
			if (!b->fill_failing)
				LOG("socket: %s (pool %d/%d)", strerror(errno), b->npool, b->pool_target);
			b->fill_failing = 1;
			return;
		}
		b->fill_failing = 0;
		b->pool[b->npool++] = s;
	}
}

int pool_take(struct broker *b)
{
	if (!b->npool)
		pool_fill(b, 1, 1);
	return b->npool ? b->pool[--b->npool] : -1;
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
static int privileged(struct broker *b, pid_t pid)
{
	char path[96];
	struct stat st;
	snprintf(path, sizeof path, "/proc/%d/ns/user", (int)pid);
	if (pid <= 0 || pid == getpid() || stat(path, &st) < 0 || st.st_dev != b->userns.st_dev ||
	    st.st_ino != b->userns.st_ino)
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
 * b->seen, or 0. */
static pid_t privileged_in(struct broker *b, const char *dir, int depth, pid_t *seen, int *nseen)
{
	char path[4096];
	snprintf(path, sizeof path, "%s/cgroup.procs", dir);
	FILE *f = fopen(path, "re");
	pid_t again = 0;
	if (f) {
		int pid;
		while (!again && fscanf(f, "%d", &pid) == 1) {
			if (!privileged(b, pid))
				continue;
			for (int i = 0; i < b->nseen; i++)
				if (b->seen[i] == pid)
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
		again = privileged_in(b, path, depth + 1, seen, nseen);
	}
	if (d)
		closedir(d);
	return again;
}

int broker_privileged(struct broker *b, pid_t pid)
{
	return b->refuse_privileged && (b->privileged || privileged(b, pid));
}

static void drop_client(struct broker *b, int i, const char *why);

/* Looks at a new client (its fd; -1: none) or, once a second, at the
 * container's cgroup; once a privileged process is found, drops every
 * client: their shims fall back to the container's own sockets. Returns
 * whether the container is refused. */
static int refused(struct broker *b, int client)
{
	if (!b->refuse_privileged || b->privileged)
		return b->privileged != 0;
	pid_t p = 0;
	if (client >= 0) {
		struct ucred uc;
		socklen_t ul = sizeof uc;
		if (getsockopt(client, SOL_SOCKET, SO_PEERCRED, &uc, &ul) == 0 && privileged(b, uc.pid))
			p = uc.pid;
	} else if (b->cgroup) {
		pid_t seen[MAX_SEEN];
		int nseen = 0;
		p = privileged_in(b, b->cgroup, 0, seen, &nseen);
		memcpy(b->seen, seen, nseen * sizeof *seen);
		b->nseen = nseen;
		b->scanned = mono_ms();
	}
	if (!p)
		return 0;
	b->privileged = p;
	b->st[SKIFF_ST_PRIVILEGED] = (uint64_t)p;
	char path[64], comm[32] = "?";
	snprintf(path, sizeof path, "/proc/%d/comm", (int)p);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		ssize_t n = read(fd, comm, sizeof comm - 1);
		comm[n > 0 ? n : 0] = 0;
		comm[strcspn(comm, "\n")] = 0;
		close(fd);
	}
	LOG("process %d (%s) holds CAP_NET_ADMIN or CAP_SYS_ADMIN in the host's user namespace: "
	    "no host sockets for this container; it uses the overlay", (int)p, comm);
	while (b->nclients)
		drop_client(b, b->nclients, "container privileged");
	return 1;
}

static void drop_client(struct broker *b, int i, const char *why)
{
	LOG("client fd %d closed (%s), %d left", b->pfd[i].fd, why, b->nclients - 1);
	close(b->pfd[i].fd);
	b->pfd[i] = b->pfd[b->nclients];   /* last client moves into slot i */
	b->held[i] = b->held[b->nclients];
	b->nclients--;
	b->st[SKIFF_ST_CLIENTS_NOW] = (uint64_t)b->nclients;
}

/* Sends up to want sockets in one message (fewer, down to none, if the pool
 * cannot cover them). Returns 0 if sent, 1 if the client has gone (its last
 * messages, such as an exit flush, are still to be read), -1 if it must be
 * dropped. */
static int send_sockets(struct broker *b, int c, int want)
{
	int have = want < b->npool ? want : b->npool, *fds = &b->pool[b->npool - have];
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
	b->npool -= have;
	if (r == (ssize_t)sizeof rep) {
		st_add(b, SKIFF_ST_HANDED_OUT, (uint64_t)have);
		return 0;
	}
	if (err == EPIPE || err == ECONNRESET)
		return 1;   /* it exited with a request outstanding */
	st_add(b, SKIFF_ST_ERRORS, 1);
	LOG("sendmsg to fd %d: %s", c, r < 0 ? strerror(err) : "short");
	return -1;
}

/* Replies c has not read yet (the hello and 'T' answers count too). */
static int unread(struct broker *b, int c)
{
	int q;
	if (ioctl(c, SIOCOUTQ, &q) < 0)
		return MAX_UNREAD;
	return (q + b->reply_bytes - 1) / b->reply_bytes;
}

/* Sends client i the replies it is owed, as far as it has read the earlier
 * ones. Returns as send_sockets. */
static int serve_held(struct broker *b, int i)
{
	while (b->held[i].n > 0 && unread(b, b->pfd[i].fd) < MAX_UNREAD) {
		int want = b->held[i].want;
		if (b->npool < want)   /* pool short (burst or small --pool): top up on the spot */
			pool_fill(b, want, MAX_POOL);
		b->held[i].n--;
		int r = send_sockets(b, b->pfd[i].fd, want);
		if (r) {
			b->held[i].n = 0;   /* gone, or to be dropped */
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
int make_transparent(struct broker *b, int fd)
{
	uint64_t ns = 0;
	socklen_t l = sizeof ns;
	int one = 1;
	if (!b->transparent)
		return EPERM;
	if (!sockopt_is(fd, SOL_SOCKET, SO_DOMAIN, AF_INET) || !sockopt_is(fd, SOL_SOCKET, SO_TYPE, SOCK_STREAM) ||
	    !sockopt_is(fd, SOL_SOCKET, SO_PROTOCOL, IPPROTO_TCP) ||
	    getsockopt(fd, SOL_SOCKET, SO_NETNS_COOKIE, &ns, &l) < 0 || ns != b->host_netns)
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
static int handle_client(struct broker *b, int i)
{
	int c = b->pfd[i].fd;
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
				st_add(b, SKIFF_ST_ERRORS, 1);
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
			st_add(b, SKIFF_ST_ERRORS, 1);
			LOG("fd %d: bad message size %zd", c, r);
			return -1;
		}
		st_add(b, SKIFF_ST_REPLACED, m.replaced);
		st_add(b, SKIFF_ST_FALLBACK, m.fallback);
		if (m.op == SKIFF_OP_SOCKETS) {
			int want = m.arg;
			if (want < 1 || want > SKIFF_MAX_BATCH) {
				st_add(b, SKIFF_ST_ERRORS, 1);
				LOG("fd %d: bad count %d", c, want);
				return -1;
			}
			if (gone)
				continue;
			if (want > MAX_REPLY)
				want = MAX_REPLY;   /* a reply may carry fewer than asked */
			if (!b->held[i].n || want < b->held[i].want)
				b->held[i].want = want;
			b->held[i].n++;
			if ((gone = serve_held(b, i)) < 0)
				return -1;
		} else if (m.op == SKIFF_OP_TRANSPARENT) {
			int err = make_transparent(b, fd);
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
			st_add(b, SKIFF_ST_ERRORS, 1);
			LOG("fd %d: unknown op 0x%02x", c, m.op);
			return -1;
		}
	}
	return 0;
}


static void accept_clients(struct broker *b, int ls)
{
	for (;;) {
		int c = accept4(ls, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (c < 0) {
			if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
				/* the connection stays queued and the listener readable:
				 * polling it now would spin */
				if (!b->accept_paused)
					LOG("accept: %s (%d clients); retrying every 100 ms", strerror(errno), b->nclients);
				st_add(b, SKIFF_ST_ERRORS, !b->accept_paused);
				b->accept_paused = 1;
				b->pfd[0].events = 0;
			} else if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
				st_add(b, SKIFF_ST_ERRORS, 1);
				LOG("accept: %s", strerror(errno));
			}
			return;
		}
		b->accept_paused = 0;
		if (refused(b, c)) {   /* the shim falls back */
			st_add(b, SKIFF_ST_ERRORS, 1);
			close(c);
			continue;
		}
		if (b->nclients >= MAX_CLIENTS) {   /* the shim falls back */
			st_add(b, SKIFF_ST_ERRORS, 1);
			LOG("client refused: %d clients already", b->nclients);
			close(c);
			continue;
		}
		ssize_t sent = send(c, &b->hello, sizeof b->hello, MSG_DONTWAIT | MSG_NOSIGNAL);
		if (sent != (ssize_t)sizeof b->hello) {
			/* a client that exited (or exec'd) while it waited in the
			 * accept queue is no broker error */
			if (sent >= 0 || (errno != EPIPE && errno != ECONNRESET)) {
				st_add(b, SKIFF_ST_ERRORS, 1);
				LOG("hello to fd %d: %s", c, sent < 0 ? strerror(errno) : "short");
			}
			close(c);
			continue;
		}
		if (b->nclients + 2 >= b->capclients) {   /* + the client, + the seccomp agent's slot */
			int cap = b->capclients ? b->capclients * 2 : 64;
			struct pollfd *p = realloc(b->pfd, cap * sizeof *p);
			if (p) b->pfd = p;
			struct held *h = p ? realloc(b->held, cap * sizeof *h) : NULL;
			if (h) b->held = h;
			if (!h) { st_add(b, SKIFF_ST_ERRORS, 1); close(c); continue; }
			b->capclients = cap;
		}
		b->nclients++;
		b->pfd[b->nclients].fd = c;
		b->pfd[b->nclients].events = POLLIN;
		b->pfd[b->nclients].revents = 0;
		b->held[b->nclients].n = 0;
		st_add(b, SKIFF_ST_CLIENTS_TOTAL, 1);
		b->st[SKIFF_ST_CLIENTS_NOW] = (uint64_t)b->nclients;
		LOG("client fd %d connected, %d open", c, b->nclients);
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


/* --keeper: holds the seccomp listeners of processes that get no host
 * sockets (no container of the host, or none the layer replaces) and
 * continues every call of theirs, so that they outlive skiffd: with no
 * holder left the kernel would fail them (ENOSYS). One per host. */
static int keep(struct broker *b)
{
	log_as("keeper");
	if (fcntl(b->control_fd, F_SETFD, FD_CLOEXEC) < 0 || sc_setup(b, b->control_fd) < 0)
		return 1;
	raise_nofile();   /* a listener per process of every container without host sockets */
	sigset_t empty;
	stop_on_signals(&empty);
	LOG("ready pid %d", (int)getpid());
	struct pollfd p = { .fd = sc_epoll(b), .events = POLLIN };
	while (!g_stop) {
		if (ppoll(&p, 1, NULL, &empty) < 0 && errno != EINTR) {
			LOG("ppoll: %s", strerror(errno));
			return 1;
		}
		if (p.revents)
			sc_ready(b);
	}
	LOG("exiting (signal), %d listeners", sc_listeners(b));
	return 0;
}

/* A descriptor number a flag passes (3..1023). */
static int fd_arg(const char *flag)
{
	char *e, msg[64];
	long v = strtol(optarg, &e, 10);
	if (*e || e == optarg || v < 3 || v > 1023) {
		snprintf(msg, sizeof msg, "bad %s (3..1023)", flag);
		die_usage(msg);
	}
	return (int)v;
}

/* Reads the command line into b; exits with usage on anything wrong. */
static void parse_args(struct broker *b, int argc, char **argv)
{
	static const struct option opts[] = {
		{ "netns", required_argument, 0, 'n' }, { "cidr", required_argument, 0, 'c' },
		{ "ip", required_argument, 0, 'i' }, { "cgroup", required_argument, 0, 'g' },
		{ "stats", required_argument, 0, 's' }, { "pool", required_argument, 0, 'p' },
		{ "name", required_argument, 0, 'N' }, { "transparent", no_argument, 0, 'T' },
		{ "listen-fd", required_argument, 0, 'L' }, { "refuse-privileged", no_argument, 0, 'P' },
		{ "control-fd", required_argument, 0, 'C' }, { "keeper", no_argument, 0, 'K' },
		{ "help", no_argument, 0, 'h' }, { 0, 0, 0, 0 } };
	char msg[600];
	int o;
	opterr = 0;
	while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (o) {
		case 'n': b->netns = optarg; break;
		case 'c': b->cidr = optarg; break;
		case 'i': b->ipstr = optarg; break;
		case 'g': b->cgroup = optarg; break;
		case 's': b->stats = optarg; break;
		case 'N': b->name = optarg; break;
		case 'T': b->transparent = 1; break;
		case 'P': b->refuse_privileged = 1; break;
		case 'K': b->keeper = 1; break;
		case 'L': b->listen_fd = fd_arg("--listen-fd"); break;
		case 'C': b->control_fd = fd_arg("--control-fd"); break;
		case 'p': {
			char *e; long v = strtol(optarg, &e, 10);
			if (*e || e == optarg || v < 0 || v > MAX_POOL) die_usage("bad --pool (0..4096)");
			b->pool_target = (int)v;
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
	if (b->keeper) {
		if (b->control_fd < 0) die_usage("--keeper needs --control-fd");
		return;
	}
	if (!b->netns == (b->listen_fd < 0)) die_usage("want one of --netns and --listen-fd");
	if (!b->cidr) die_usage("missing --cidr");
	if (!b->ipstr) die_usage("missing --ip");
	if (!*b->name || strlen(b->name) > sizeof(((struct sockaddr_un *)0)->sun_path) - 2)
		die_usage("bad --name");

	struct skiff_hello *h = &b->hello;
	*h = (struct skiff_hello){ .magic = SKIFF_HELLO_MAGIC, .version = SKIFF_PROTO_VERSION };
	char buf[64];
	const char *sl = strchr(b->cidr, '/');
	char *e;
	if (!sl || sl - b->cidr >= (long)sizeof buf) die_usage("bad --cidr (want A.B.C.D/LEN)");
	memcpy(buf, b->cidr, sl - b->cidr); buf[sl - b->cidr] = 0;
	long len = strtol(sl + 1, &e, 10);
	if (*e || e == sl + 1 || len < 0 || len > 32 || parse_ip(buf, &h->net))
		die_usage("bad --cidr (want A.B.C.D/LEN)");
	uint32_t mask = len ? htonl(~0u << (32 - len)) : 0;
	if (h->net & ~mask) die_usage("bad --cidr: host bits set");
	h->prefix = (uint8_t)len;
	if (parse_ip(b->ipstr, &h->ip)) die_usage("bad --ip");
	if ((h->ip & mask) != h->net) die_usage("--ip is not inside --cidr");
	b->net = h->net;
	b->mask = mask;
	b->ip = h->ip;
}

/* Maps the stats file (--stats), reading first what notification a broker
 * before this one left unanswered: its caller waits until someone does. */
static int map_stats(struct broker *b)
{
	int old = open(b->stats, O_RDONLY | O_CLOEXEC);
	uint64_t prev[SKIFF_ST_NSLOTS] = { 0 };
	if (old >= 0) {
		if (read(old, prev, sizeof prev) == (ssize_t)sizeof prev && prev[SKIFF_ST_MAGIC] == SKIFF_STATS_MAGIC)
			b->inflight = prev[SKIFF_ST_SC_INFLIGHT];
		close(old);
	}
	int fd = open(b->stats, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd < 0 || ftruncate(fd, SKIFF_STATS_SIZE) < 0) {
		fprintf(stderr, "skiff-broker: stats %s: %s\n", b->stats, strerror(errno));
		return -1;
	}
	void *p = mmap(NULL, SKIFF_STATS_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED) { fprintf(stderr, "skiff-broker: mmap %s: %s\n", b->stats, strerror(errno)); return -1; }
	close(fd);
	b->st = p;
	return 0;
}

/* The shim's listener: bound in the container's netns (--netns) or the
 * one skiffd passed (--listen-fd). Everything else lives in the host
 * netns. Returns it, or -1 (logged). */
static int open_listener(struct broker *b)
{
	if (!b->netns) {
		int err = adopt_listener(b->listen_fd);
		if (err) {
			fprintf(stderr, "skiff-broker: --listen-fd %d: %s\n", b->listen_fd, strerror(err));
			return -1;
		}
		return b->listen_fd;
	}
	int nsfd = open(b->netns, O_RDONLY | O_CLOEXEC);
	if (nsfd < 0) { fprintf(stderr, "skiff-broker: open netns %s: %s\n", b->netns, strerror(errno)); return -1; }
	int hostfd = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
	if (hostfd < 0) { fprintf(stderr, "skiff-broker: open /proc/self/ns/net: %s\n", strerror(errno)); return -1; }
	if (setns(nsfd, CLONE_NEWNET) < 0) {
		fprintf(stderr, "skiff-broker: setns %s: %s\n", b->netns, strerror(errno));
		return -1;
	}
	int ls = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0), lerr = 0;
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	size_t nl = strlen(b->name);
	memcpy(sa.sun_path + 1, b->name, nl);
	socklen_t salen = offsetof(struct sockaddr_un, sun_path) + 1 + nl;
	if (ls < 0 || bind(ls, (struct sockaddr *)&sa, salen) < 0 || listen(ls, 512) < 0)
		lerr = errno;
	if (setns(hostfd, CLONE_NEWNET) < 0) {
		fprintf(stderr, "skiff-broker: setns back to host netns: %s\n", strerror(errno));
		return -1;
	}
	close(hostfd);
	close(nsfd);
	if (lerr) {
		fprintf(stderr, "skiff-broker: listen on @%s in %s: %s\n", b->name, b->netns, strerror(lerr));
		return -1;
	}
	return ls;
}

/* Everything the loop needs: the cgroup joined, the stats mapped, the
 * listener, the netns cookies, the pool, the seccomp agent, the signals.
 * Returns the listener, or -1 (logged). */
static int open_broker(struct broker *b)
{
	if (b->refuse_privileged && stat("/proc/self/ns/user", &b->userns) < 0) {
		fprintf(stderr, "skiff-broker: /proc/self/ns/user: %s\n", strerror(errno));
		return -1;
	}
	if (b->cgroup) {
		char path[4096];
		snprintf(path, sizeof path, "%s/cgroup.procs", b->cgroup);
		int fd = open(path, O_WRONLY | O_CLOEXEC);
		if (fd < 0 || write(fd, "0", 1) != 1) {
			fprintf(stderr, "skiff-broker: join cgroup %s: %s\n", b->cgroup, strerror(errno));
			return -1;
		}
		close(fd);
	}
	if (b->stats && map_stats(b) < 0)
		return -1;
	b->st[SKIFF_ST_PID] = (uint64_t)getpid();
	int ls = open_listener(b);
	if (ls < 0)
		return -1;
	/* the shim checks a socket is one of ours before it replaces it */
	int s = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	socklen_t l = sizeof b->hello.host_netns;
	if (s < 0 || getsockopt(s, SOL_SOCKET, SO_NETNS_COOKIE, &b->hello.host_netns, &l) < 0) {
		fprintf(stderr, "skiff-broker: netns cookie: %s\n", strerror(errno));
		return -1;
	}
	close(s);
	b->host_netns = b->hello.host_netns;
	/* the container's: the only sockets the seccomp agent swaps */
	l = sizeof b->container_netns;
	if (getsockopt(ls, SOL_SOCKET, SO_NETNS_COOKIE, &b->container_netns, &l) < 0)
		b->container_netns = 0;

	/* one connection per process of the container, plus the pool: a
	 * container of many processes (prefork servers) needs more than the
	 * usual soft limit of 1024 */
	raise_nofile();
	b->pool = calloc(MAX_POOL, sizeof(int));
	b->capclients = 64;
	b->pfd = calloc(b->capclients, sizeof *b->pfd);
	b->held = calloc(b->capclients, sizeof *b->held);
	if (!b->pool || !b->pfd || !b->held) { fprintf(stderr, "skiff-broker: out of memory\n"); return -1; }
	int rb = measure_reply_bytes();
	if (rb > 0)
		b->reply_bytes = rb;
	b->pfd[0].fd = ls;
	b->pfd[0].events = POLLIN;
	/* the seccomp agent's: control socket and listeners behind one epoll,
	 * polled after the clients */
	if (b->control_fd >= 0 && (fcntl(b->control_fd, F_SETFD, FD_CLOEXEC) < 0 || sc_setup(b, b->control_fd) < 0))
		return -1;
	return ls;
}

/* Serves until a signal (0) or an error (1). */
static int run(struct broker *b, int ls)
{
	sigset_t empty;
	stop_on_signals(&empty);
	signal(SIGPIPE, SIG_IGN);
	/* written after everything is set up (listener bound, stats mapped): readers
	 * may treat a valid magic as "broker ready" */
	b->st[SKIFF_ST_MAGIC] = SKIFF_STATS_MAGIC;

	/* Refilling is background work: as SCHED_BATCH the broker's wake-up
	 * (a shim asking for its next batch) does not preempt the application
	 * that asked, which still has sockets in hand. */
	struct sched_param sp = { 0 };
	int batch = sched_setscheduler(0, SCHED_BATCH, &sp) == 0;
	if (!batch)
		LOG("SCHED_BATCH: %s", strerror(errno));
	pool_fill(b, b->pool_target, MAX_POOL);
	{
		char nb[INET_ADDRSTRLEN], ib[INET_ADDRSTRLEN];
		inet_ntop(AF_INET, &b->hello.net, nb, sizeof nb);
		inet_ntop(AF_INET, &b->hello.ip, ib, sizeof ib);
		LOG("ready pid %d netns %s cidr %s/%u ip %s pool %d%s%s", (int)getpid(), b->netns ? b->netns : "of --listen-fd", nb,
		    b->hello.prefix, ib, b->npool, b->cgroup ? " cgroup " : "", b->cgroup ? b->cgroup : "");
	}

	while (!g_stop) {
		/* while the pool is short, poll without waiting: it refills a few
		 * sockets at a time between polls (every 100 ms while socket() fails) */
		static const struct timespec now = { 0, 0 }, retry = { 0, 100 * 1000 * 1000 };
		static const struct timespec held = { 0, 5 * 1000 * 1000 };
		const struct timespec *wait = b->npool >= b->pool_target ? NULL : b->fill_failing ? &retry : &now;
		if (b->accept_paused && !wait)
			wait = &retry;
		static const struct timespec second = { 1, 0 };
		int watching = b->refuse_privileged && !b->privileged && b->cgroup;
		if (watching && !wait)
			wait = &second;
		/* replies held back: look again soon whether their clients read */
		for (int i = 1; i <= b->nclients && wait != &now; i++)
			if (b->held[i].n) { wait = &held; break; }
		/* a notification's target waits until the broker answers: it
		 * must wake the broker at once, which SCHED_BATCH does not */
		if (batch && b->sc && sc_listeners(b) > 0)
			batch = sched_setscheduler(0, SCHED_OTHER, &sp) < 0;
		int npfd = 1 + b->nclients;
		if (b->sc) {
			b->pfd[npfd].fd = sc_epoll(b);
			b->pfd[npfd].events = POLLIN;
			b->pfd[npfd++].revents = 0;
		}
		int r = ppoll(b->pfd, npfd, wait, &empty);
		if (r < 0) {
			if (errno == EINTR) continue;
			LOG("ppoll: %s", strerror(errno));
			break;
		}
		if (b->sc && b->pfd[1 + b->nclients].revents)
			sc_ready(b);
		if (b->accept_paused) {   /* try again after any wake-up, at the latest on the timer */
			b->pfd[0].events = POLLIN;
			b->pfd[0].revents = POLLIN;
		}
		for (int i = b->nclients; i >= 1; i--) {   /* backwards: drop_client moves the last one into i */
			short re = b->pfd[i].revents;
			if (!re) continue;
			b->pfd[i].revents = 0;
			if (re & POLLIN) {
				if (handle_client(b, i) < 0) { drop_client(b, i, "eof/error"); continue; }
			} else if (re & (POLLHUP | POLLERR | POLLNVAL)) {
				drop_client(b, i, "hangup");
			}
		}
		for (int i = b->nclients; i >= 1; i--)
			if (b->held[i].n && serve_held(b, i) < 0)
				drop_client(b, i, "eof/error");
		/* at least a second apart: a process privileged for less
		 * than that is seen in one scan at most */
		if (watching && mono_ms() - b->scanned >= 1000)
			refused(b, -1);
		if (b->pfd[0].revents & POLLIN)
			accept_clients(b, ls);
		b->pfd[0].revents = 0;
		/* Off the critical path, since replies already went out, and in
		 * steps: a burst of socket creation would hold up the connections
		 * of whoever shares this CPU. */
		if (b->npool < b->pool_target) {
			pool_fill(b, b->pool_target, REFILL_STEP);
			sched_yield();
		}
	}
	LOG("exiting (%s), handed out %llu", g_stop ? "signal" : "error",
	    (unsigned long long)b->st[SKIFF_ST_HANDED_OUT]);
	b->st[SKIFF_ST_CLIENTS_NOW] = 0;
	return g_stop ? 0 : 1;
}

int main(int argc, char **argv)
{
	static struct broker broker = { .name = SKIFF_BROKER_NAME, .listen_fd = -1, .control_fd = -1,
					.pool_target = 64, .reply_bytes = 1024 };
	struct broker *b = &broker;
	b->st = b->dummy;
	parse_args(b, argc, argv);
	log_as(b->name);
	if (b->keeper)
		return keep(b);
	int ls = open_broker(b);
	return ls < 0 ? 1 : run(b, ls);
}
