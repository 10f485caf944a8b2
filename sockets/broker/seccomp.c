//go:build ignore

/* seccomp.c - the broker's seccomp agent: host sockets for programs that do
 * not preload the shim (static and Go binaries, unmodified images).
 *
 * skiff's profile (./seccomp) makes the kernel notify connect() with a
 * 16-byte address and listen() of untagged descriptors; the runtime hands
 * the listener to skiffd, which passes it here (SKIFF_CTL_LISTENER). For each:
 *   connect(N, addr): addr in the cluster or loopback, N an unbound TCP/IPv4
 *     socket of the container's namespace in no epoll: the broker takes a
 *     host socket H (made in the container's cgroup; kept out of same-host
 *     channels: take_host_socket), copies N's options,
 *     and connects H itself, non-blocking: the layer's connect4 gives the
 *     verdict on the broker's own copy of the address. Taken: H's flags
 *     become N's, ADDFD SETFD puts H at N (closing the container's socket),
 *     and the call answers EINPROGRESS (non-blocking N) or continues: the
 *     kernel's connect on a connecting socket waits for the handshake and
 *     returns its result, as a blocking connect does. Refused (the shim's
 *     fallback errnos): H goes, the call continues on the container's own
 *     socket (the overlay), as with the shim.
 *   listen(N, backlog): the same checks; H is bound to N's port on any
 *     address, made IP_TRANSPARENT and listens; if sockops left it on lo, or
 *     anything fails, the container's own socket listens.
 * Everything else continues untouched. Security never rests on the target's
 * memory: the kernel judges the broker's own calls on its own copies, and
 * each read of the target is followed by NOTIF_ID_VALID.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <linux/audit.h>
#include <linux/kcmp.h>
#include <linux/seccomp.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/uio.h>

#include "skiff_broker.h"
#include "broker.h"
#include "../optset.h"

#ifndef PIDFD_THREAD
#define PIDFD_THREAD O_EXCL
#endif
#if defined(__x86_64__)
#define NATIVE_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define NATIVE_ARCH AUDIT_ARCH_AARCH64
#endif

#define MAX_LISTENERS 4096   /* a process whose listener finds no room waits: logged */

/* A receive waits at most this long. Two holders of one listener (a keeper
 * given it while its broker still runs) both wake for a notification and
 * one receives it; the other's receive would wait for the filter's next
 * notification, which may never come, and serve nothing else meanwhile. */
#define RECV_BOUND_US 100000

/* What the broker knows of a calling thread, looked up at most once a
 * second: whether it may hold CAP_NET_ADMIN or CAP_SYS_ADMIN in the host's
 * user namespace (secure mode: no host sockets for it, as for the shim),
 * and its process's epoll descriptors (a swap would lose a registration:
 * epoll keys on the file). By thread id, which is what a notification
 * names. */
#define MAX_EPS 32
#define NCALLERS 16
struct caller {
	pid_t tid;
	uint64_t at;
	int privileged;
	int neps;   /* -1: more than MAX_EPS, each socket counts as registered */
	int eps[MAX_EPS];
};

/* The agent's state (struct broker's sc). */
struct seccomp_agent {
	int ep, ctl;        /* the epoll of the control socket and the listeners, the control socket */
	int nlisteners;
	struct seccomp_notif_sizes sizes;
	struct seccomp_notif *req;       /* the notification being served */
	struct seccomp_notif_resp *resp;
	struct caller callers[NCALLERS];
	int release[2];     /* the descriptors to release once the call is answered */
};

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int sc_epoll(struct broker *b) { return b->sc->ep; }
int sc_listeners(struct broker *b) { return b->sc->nlisteners; }

/* SIGALRM only ends a receive: installed without SA_RESTART. */
static void on_alarm(int sig) { (void)sig; }

int sc_setup(struct broker *b, int ctl)
{
	struct sigaction sa = { .sa_handler = on_alarm };
	if (sigaction(SIGALRM, &sa, NULL) < 0) {
		LOG("seccomp agent: SIGALRM: %s", strerror(errno));
		return -1;
	}
	struct seccomp_agent *sc = calloc(1, sizeof *sc);
	if (!sc || syscall(SYS_seccomp, SECCOMP_GET_NOTIF_SIZES, 0, &sc->sizes) < 0) {
		LOG("seccomp notification sizes: %s", strerror(errno));
		free(sc);
		return -1;
	}
	size_t rq = sc->sizes.seccomp_notif > sizeof *sc->req ? sc->sizes.seccomp_notif : sizeof *sc->req;
	size_t rs = sc->sizes.seccomp_notif_resp > sizeof *sc->resp ? sc->sizes.seccomp_notif_resp : sizeof *sc->resp;
	sc->req = calloc(1, rq);
	sc->resp = calloc(1, rs);
	sc->release[0] = sc->release[1] = -1;
	sc->ctl = ctl;
	sc->ep = epoll_create1(EPOLL_CLOEXEC);
	struct epoll_event ev = { .events = EPOLLIN, .data.fd = ctl };
	if (!sc->req || !sc->resp || sc->ep < 0 || epoll_ctl(sc->ep, EPOLL_CTL_ADD, ctl, &ev) < 0) {
		LOG("seccomp agent: %s", strerror(errno));
		return -1;
	}
	b->sc = sc;
	return 0;
}

static int is_listener(int fd)
{
	char path[64], link[64];
	snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
	ssize_t n = readlink(path, link, sizeof link - 1);
	if (n < 0)
		return 0;
	link[n] = 0;
	return !strcmp(link, "anon_inode:seccomp notify");
}

static void drop_listener(struct broker *b, int fd)
{
	struct seccomp_agent *sc = b->sc;
	epoll_ctl(sc->ep, EPOLL_CTL_DEL, fd, NULL);
	close(fd);
	sc->nlisteners--;
	b->st[SKIFF_ST_SC_LISTENERS] = (uint64_t)sc->nlisteners;
}

static int reply(struct broker *b, int lfd, int32_t error, uint32_t flags)
{
	struct seccomp_agent *sc = b->sc;
	memset(sc->resp, 0, sc->sizes.seccomp_notif_resp);
	sc->resp->id = sc->req->id;
	sc->resp->error = error;
	sc->resp->flags = flags;
	return ioctl(lfd, SECCOMP_IOCTL_NOTIF_SEND, sc->resp);
}

/* A message from skiffd: a listener to serve. */
static void control(struct broker *b)
{
	struct seccomp_agent *sc = b->sc;
	for (;;) {
		uint8_t op;
		struct iovec iov = { &op, 1 };
		union skiff_fds_cmsg u;
		struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1 };
		skiff_expect_fds(&m, &u, 1);
		ssize_t r = recvmsg(sc->ctl, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		if (r < 0 && (errno == EAGAIN || errno == EINTR))
			return;
		if (r <= 0) {
			/* skiffd holds the other end for as long as the broker runs; a
			 * restarted skiffd takes the broker's copy of it back */
			LOG("control socket closed");
			epoll_ctl(sc->ep, EPOLL_CTL_DEL, sc->ctl, NULL);
			return;
		}
		int fd = -1;
		int n = skiff_received_fds(&m, &fd, 1);
		if (r != 1 || op != SKIFF_CTL_LISTENER || n != 1 || (m.msg_flags & MSG_CTRUNC) || !is_listener(fd) ||
		    sc->nlisteners >= MAX_LISTENERS) {
			if (n == 1)
				close(fd);
			st_add(b, SKIFF_ST_ERRORS, 1);
			LOG("control: refused a message (op 0x%02x, %d fds, %d listeners held)", op, n, sc->nlisteners);
			continue;
		}
		struct epoll_event ev = { .events = EPOLLIN, .data.fd = fd };
		if (epoll_ctl(sc->ep, EPOLL_CTL_ADD, fd, &ev) < 0) {
			st_add(b, SKIFF_ST_ERRORS, 1);
			LOG("control: epoll: %s", strerror(errno));
			close(fd);
			continue;
		}
		sc->nlisteners++;
		b->st[SKIFF_ST_SC_LISTENERS] = (uint64_t)sc->nlisteners;
		if (b->inflight) {   /* left by the broker before: continue it, if it is this listener's */
			sc->req->id = b->inflight;
			if (reply(b, fd, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE) == 0) {
				LOG("continued notification %llx the previous broker left", (unsigned long long)b->inflight);
				b->inflight = 0;
			}
		}
		LOG("seccomp listener fd %d, %d held", fd, sc->nlisteners);
	}
}

/* The options copied from the caller's socket, in sks_optset's bit order. */
struct opt { int level, name; socklen_t len; };
static const struct opt g_opts[] = {
#define OPT(l, n, len) { l, n, len },
	SKS_OPTSET(OPT)
#undef OPT
};
#define NOPTS (int)(sizeof g_opts / sizeof g_opts[0])
_Static_assert(NOPTS < SKS_OPTSET_OTHER, "sks_optset is 32 bits, the last for any other option");

/* Copies the options the program set on s to h: 0, or -1 if the layer
 * does not say which it set, or it set one outside those the broker copies
 * (see optset.h), or h refused one. */
static int copy_options(int s, int h)
{
	uint32_t set = 0;
	socklen_t sl = sizeof set;
	if (getsockopt(s, SKS_OPTSET_LEVEL, SKS_OPTSET_NAME, &set, &sl) < 0 || sl != sizeof set ||
	    (set & (1u << SKS_OPTSET_OTHER)))
		return -1;
	for (int i = 0; set && i < NOPTS; i++, set >>= 1) {
		if (!(set & 1))
			continue;
		char v[16] = { 0 };
		socklen_t l = g_opts[i].len;
		if (getsockopt(s, g_opts[i].level, g_opts[i].name, v, &l) < 0)
			return -1;
		if (g_opts[i].level == SOL_SOCKET && (g_opts[i].name == SO_RCVBUF || g_opts[i].name == SO_SNDBUF))
			*(int *)v /= 2;   /* reads back doubled */
		if (setsockopt(h, g_opts[i].level, g_opts[i].name, v, l) < 0)
			return -1;
	}
	return 0;
}


/* A host socket for a program under the profile: from the pool, kept out of
 * same-host channels (SKIFF_SO_NOCHANNEL): a channelled socket's blocking
 * read can fail with a spurious EAGAIN, which only the shim retries. No
 * channels layer (ENOPROTOOPT) changes nothing; any other refusal leaves the
 * program its own socket. */
static int take_host_socket(struct broker *b)
{
	int h = pool_take(b), one = 1;
	if (h >= 0 && setsockopt(h, SKIFF_SOL, SKIFF_SO_NOCHANNEL, &one, sizeof one) < 0 && errno != ENOPROTOOPT) {
		LOG("seccomp: host socket not kept out of channels: %s", strerror(errno));
		close(h);
		return -1;
	}
	return h;
}

static struct caller *caller(struct broker *b, pid_t tid)
{
	struct seccomp_agent *sc = b->sc;
	struct caller *c = &sc->callers[(unsigned)tid % NCALLERS];
	uint64_t t = now_ns();
	if (c->tid == tid && t - c->at < 1000000000ull)
		return c;
	c->tid = tid;
	c->at = t;
	c->privileged = broker_privileged(b, tid);
	c->neps = 0;
	char path[300], link[64];
	snprintf(path, sizeof path, "/proc/%d/fd", (int)tid);
	DIR *d = opendir(path);
	for (struct dirent *e; d && (e = readdir(d));) {
		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof path, "/proc/%d/fd/%s", (int)tid, e->d_name);
		ssize_t l = readlink(path, link, sizeof link - 1);
		if (l <= 0 || (link[l] = 0, strcmp(link, "anon_inode:[eventpoll]")))
			continue;
		if (c->neps == MAX_EPS) {
			c->neps = -1;
			break;
		}
		c->eps[c->neps++] = atoi(e->d_name);
	}
	if (d)
		closedir(d);
	return c;
}

/* Whether the caller's fd n is registered in one of its epolls. */
static int in_epoll(const struct caller *c, int n)
{
	if (c->neps < 0)
		return 1;
	for (int i = 0; i < c->neps; i++) {
		struct kcmp_epoll_slot slot = { .efd = (uint32_t)c->eps[i], .tfd = (uint32_t)n, .toff = 0 };
		if (syscall(SYS_kcmp, c->tid, c->tid, KCMP_EPOLL_TFD, n, &slot) == 0)
			return 1;
	}
	return 0;
}

/* Whether the target's fd n has FD_CLOEXEC. */
static int cloexec(pid_t pid, int n)
{
	char path[64], buf[256];
	snprintf(path, sizeof path, "/proc/%d/fdinfo/%d", (int)pid, n);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t r = read(fd, buf, sizeof buf - 1);
	close(fd);
	if (r <= 0)
		return 0;
	buf[r] = 0;
	char *f = strstr(buf, "flags:");
	return f && (strtoul(f + 6, NULL, 8) & O_CLOEXEC);
}

/* A pidfd of thread tid's process: of the thread itself where the kernel
 * has PIDFD_THREAD (6.9), else of its thread group leader. */
static int pidfd_of(pid_t tid)
{
	int fd = syscall(SYS_pidfd_open, tid, PIDFD_THREAD);
	if (fd >= 0 || errno != EINVAL)
		return fd;
	char path[64], line[128];
	snprintf(path, sizeof path, "/proc/%d/status", (int)tid);
	FILE *f = fopen(path, "re");
	int tgid = 0;
	while (f && !tgid && fgets(line, sizeof line, f))
		sscanf(line, "Tgid: %d", &tgid);
	if (f)
		fclose(f);
	return tgid > 0 ? syscall(SYS_pidfd_open, tgid, 0) : -1;
}

enum outcome { PASSED, FALLBACK, REPLACED, DROPPED };

/* The caller's socket n, if it is a TCP/IPv4 socket of the container's
 * namespace that has not connected, with where it is bound in *bound; else
 * -1 (the call is passed). */
static int target_socket(struct broker *b, int lfd, pid_t tid, int n, struct sockaddr_in *bound)
{
	struct seccomp_agent *sc = b->sc;
	int pidfd = pidfd_of(tid);
	if (pidfd < 0)
		return -1;   /* gone: the answer finds out */
	if (ioctl(lfd, SECCOMP_IOCTL_NOTIF_ID_VALID, &sc->req->id) < 0) {
		close(pidfd);   /* the caller went, and tid may be another's now */
		return -1;
	}
	int s = syscall(SYS_pidfd_getfd, pidfd, n, 0);
	close(pidfd);
	if (s < 0)
		return -1;   /* not a descriptor: the kernel answers EBADF */
	uint64_t ns = 0;
	socklen_t l = sizeof ns, bl = sizeof *bound;
	struct tcp_info ti;
	socklen_t tl = sizeof ti;
	/* Three reads: IPv4 (getsockname), TCP (only TCP and MPTCP answer
	 * TCP_INFO: Go 1.24 on makes its listeners MPTCP, which takes plain
	 * TCP peers, so a host TCP listener serves them the same) and not in
	 * use, of the container's namespace: not a host socket already (the
	 * shim's), nor a socket of another container whose listener was handed
	 * over as this one's, which must never get this container's sockets */
	if (getsockname(s, (struct sockaddr *)bound, &bl) < 0 || bound->sin_family != AF_INET ||
	    getsockopt(s, SOL_SOCKET, SO_NETNS_COOKIE, &ns, &l) < 0 || ns != b->container_netns ||
	    getsockopt(s, SOL_TCP, TCP_INFO, &ti, &tl) < 0 || ti.tcpi_state != TCP_CLOSE) {
		close(s);
		return -1;
	}
	sc->release[0] = s;
	return s;
}

/* Puts h at the target's fd n in place of s (closing s there), with s's
 * O_NONBLOCK (in fl, s's file flags): 0, or -1. */
static int swap_in(struct broker *b, int lfd, pid_t pid, int n, int s, int fl, int h)
{
	struct seccomp_agent *sc = b->sc;
	if (fcntl(h, F_SETFL, fl & O_NONBLOCK) < 0)
		return -1;
	/* n is still s: the target did not close and reuse it meanwhile */
	if (syscall(SYS_kcmp, pid, getpid(), KCMP_FILE, n, s) != 0)
		return -1;
	struct seccomp_notif_addfd add = { .id = sc->req->id, .flags = SECCOMP_ADDFD_FLAG_SETFD, .srcfd = (uint32_t)h,
					   .newfd = (uint32_t)n, .newfd_flags = cloexec(pid, n) ? O_CLOEXEC : 0 };
	return ioctl(lfd, SECCOMP_IOCTL_NOTIF_ADDFD, &add) == n ? 0 : -1;
}

/* connect(n, addr): REPLACED (the call answered with error and flags) or why
 * not; every call not replaced continues on the program's own socket. */
static enum outcome on_connect(struct broker *b, int lfd, int32_t *error, uint32_t *flags)
{
	struct seccomp_agent *sc = b->sc;
	pid_t tid = (pid_t)sc->req->pid;
	int n = (int)sc->req->data.args[0];
	struct sockaddr_in sa;
	struct iovec local = { &sa, sizeof sa }, remote = { (void *)(uintptr_t)sc->req->data.args[1], sizeof sa };
	if (process_vm_readv(tid, &local, 1, &remote, 1, 0) != (ssize_t)sizeof sa ||
	    ioctl(lfd, SECCOMP_IOCTL_NOTIF_ID_VALID, &sc->req->id) < 0)
		return PASSED;
	if (sa.sin_family != AF_INET || !skiff_fast_ip(sa.sin_addr.s_addr, b->net, b->mask))
		return PASSED;
	struct sockaddr_in bound;
	int s = target_socket(b, lfd, tid, n, &bound);
	if (s < 0)
		return PASSED;
	/* a socket bound first, in an epoll, with an option the broker does not
	 * copy, of a privileged process, or a connect the layer refuses stays
	 * the program's (the overlay); another error the program's socket meets
	 * by itself */
	struct caller *c = caller(b, tid);
	if (c->privileged || in_epoll(c, n) || bound.sin_port || bound.sin_addr.s_addr)
		return FALLBACK;
	int h = take_host_socket(b);
	if (h < 0)
		return FALLBACK;
	sc->release[1] = h;
	if (copy_options(s, h) < 0 || fcntl(h, F_SETFL, O_NONBLOCK) < 0 ||
	    (connect(h, (struct sockaddr *)&sa, sizeof sa) < 0 && errno != EINPROGRESS))
		return FALLBACK;
	int fl = fcntl(s, F_GETFL);
	if (fl < 0 || swap_in(b, lfd, tid, n, s, fl, h) < 0)
		return FALLBACK;
	if (fl & O_NONBLOCK) {
		*error = -EINPROGRESS;
		*flags = 0;
	}
	/* blocking: the call continues, and the kernel's connect on the
	 * connecting socket waits for the handshake and returns its result */
	return REPLACED;
}

/* listen(n, backlog): as on_connect. */
static enum outcome on_listen(struct broker *b, int lfd, int32_t *error, uint32_t *flags)
{
	struct seccomp_agent *sc = b->sc;
	pid_t tid = (pid_t)sc->req->pid;
	int n = (int)sc->req->data.args[0], backlog = (int)sc->req->data.args[1];
	struct sockaddr_in bound;
	int s = target_socket(b, lfd, tid, n, &bound);
	if (s < 0)
		return PASSED;
	struct caller *c = caller(b, tid);
	struct sockaddr_in any = { .sin_family = AF_INET, .sin_port = bound.sin_port };
	const char *why = NULL;
	int h = -1;
	if (c->privileged)
		why = "a privileged process";
	else if (in_epoll(c, n))
		why = "in an epoll";
	else if (bound.sin_addr.s_addr != INADDR_ANY && bound.sin_addr.s_addr != b->ip)
		why = "bound to another address";
	else if (!sockopt_is(s, SOL_SOCKET, SO_REUSEPORT, 0))
		why = "SO_REUSEPORT (the kernel shares the port in the container's namespace)";
	else if ((h = sc->release[1] = take_host_socket(b)) < 0)
		why = "no host socket";
	else if (copy_options(s, h) < 0)
		why = "an option the broker does not copy";
	else if (bind(h, (struct sockaddr *)&any, sizeof any) < 0)
		why = "bind refused";
	else if (make_transparent(b, h))
		why = "not made transparent";
	else if (listen(h, backlog) < 0)
		why = "listen refused";
	else if (skiff_on_lo(h))
		why = "not publishable (left on lo)";
	else if (swap_in(b, lfd, tid, n, s, fcntl(s, F_GETFL), h) < 0)
		why = "swap failed";
	if (why) {
		LOG("seccomp: listen(%d) of %d stays on the overlay: %s", n, (int)tid, why);
		return FALLBACK;
	}
	*error = 0;
	*flags = 0;   /* the host socket listens */
	return REPLACED;
}

static void serve(struct broker *b, int lfd)
{
	struct seccomp_agent *sc = b->sc;
	memset(sc->req, 0, sc->sizes.seccomp_notif);
	static const struct itimerval bound = { .it_value = { .tv_usec = RECV_BOUND_US } }, off = { 0 };
	setitimer(ITIMER_REAL, &bound, NULL);
	int r = ioctl(lfd, SECCOMP_IOCTL_NOTIF_RECV, sc->req);
	setitimer(ITIMER_REAL, &off, NULL);
	if (r < 0)
		return;   /* the target went (ENOENT), another holder took it (EINTR at the bound) */
	uint64_t t0 = now_ns();
	b->st[SKIFF_ST_SC_INFLIGHT] = sc->req->id;
	enum outcome out = PASSED;
	int32_t error = 0;
	uint32_t flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
#ifdef NATIVE_ARCH
	if (!b->keeper && sc->req->data.arch == NATIVE_ARCH && sc->req->data.nr == SYS_connect)
		out = on_connect(b, lfd, &error, &flags);
	else if (!b->keeper && sc->req->data.arch == NATIVE_ARCH && sc->req->data.nr == SYS_listen)
		out = on_listen(b, lfd, &error, &flags);
#endif
	/* every notification is answered: one left would leave its caller
	 * waiting for good */
	if (reply(b, lfd, error, flags) < 0 && errno == ENOENT)
		out = DROPPED;
	/* after the answer: the last reference to the container's socket
	 * goes here, and releasing it takes microseconds */
	for (int i = 0; i < 2; i++)
		if (sc->release[i] >= 0) {
			close(sc->release[i]);
			sc->release[i] = -1;
		}
	static const int slot[] = { [PASSED] = SKIFF_ST_SC_PASSED, [FALLBACK] = SKIFF_ST_SC_FALLBACK,
				    [REPLACED] = SKIFF_ST_SC_REPLACED, [DROPPED] = SKIFF_ST_SC_DROPPED };
	st_add(b, slot[out], 1);
	st_add(b, SKIFF_ST_SC_NS, now_ns() - t0);
	st_add(b, SKIFF_ST_SC_HANDLED, 1);
	b->st[SKIFF_ST_SC_INFLIGHT] = 0;
}

void sc_ready(struct broker *b)
{
	struct seccomp_agent *sc = b->sc;
	struct epoll_event evs[16];
	int n = epoll_wait(sc->ep, evs, 16, 0);
	for (int i = 0; i < n; i++) {
		int fd = evs[i].data.fd;
		if (fd == sc->ctl)
			control(b);
		else if (evs[i].events & EPOLLIN)
			serve(b, fd);
		else if (evs[i].events & (EPOLLHUP | EPOLLERR))
			drop_listener(b, fd);   /* no process uses the filter any more */
	}
}
