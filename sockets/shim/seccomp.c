/* seccomp.c - the broker's seccomp agent: host sockets for programs that do
 * not preload the shim (static and Go binaries, unmodified images).
 *
 * skiff's profile (sockets/seccomp) makes the kernel notify connect() with a
 * 16-byte address and listen() of untagged descriptors; the runtime hands
 * the listener to skiffd, which passes it here (SKIFF_CTL_LISTENER). For each:
 *   connect(N, addr): addr in the cluster or loopback, N an unbound TCP/IPv4
 *     socket of the container's namespace in no epoll: the broker takes a
 *     host socket H (made in the container's cgroup), copies N's options,
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
#include <sys/uio.h>

#include "skiff_broker.h"
#include "broker.h"
#include "../optset.h"

#ifndef PIDFD_THREAD
#define PIDFD_THREAD O_EXCL
#endif
#ifndef SO_BINDTOIFINDEX
#define SO_BINDTOIFINDEX 62
#endif
#if defined(__x86_64__)
#define NATIVE_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define NATIVE_ARCH AUDIT_ARCH_AARCH64
#endif

#define MAX_LISTENERS 4096   /* a process whose listener finds no room waits: logged */

static int g_ep = -1, g_ctl = -1;
static int g_nlisteners;
static struct seccomp_notif_sizes g_sizes;
static struct seccomp_notif *g_req;
static struct seccomp_notif_resp *g_resp;

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int sc_epoll(void) { return g_ep; }
int sc_listeners(void) { return g_nlisteners; }

int sc_setup(int ctl)
{
	if (syscall(SYS_seccomp, SECCOMP_GET_NOTIF_SIZES, 0, &g_sizes) < 0) {
		LOG("seccomp notification sizes: %s", strerror(errno));
		return -1;
	}
	size_t rq = g_sizes.seccomp_notif > sizeof *g_req ? g_sizes.seccomp_notif : sizeof *g_req;
	size_t rs = g_sizes.seccomp_notif_resp > sizeof *g_resp ? g_sizes.seccomp_notif_resp : sizeof *g_resp;
	g_req = calloc(1, rq);
	g_resp = calloc(1, rs);
	g_ep = epoll_create1(EPOLL_CLOEXEC);
	struct epoll_event ev = { .events = EPOLLIN, .data.fd = ctl };
	if (!g_req || !g_resp || g_ep < 0 || epoll_ctl(g_ep, EPOLL_CTL_ADD, ctl, &ev) < 0) {
		LOG("seccomp agent: %s", strerror(errno));
		return -1;
	}
	g_ctl = ctl;
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

static void drop_listener(int fd)
{
	epoll_ctl(g_ep, EPOLL_CTL_DEL, fd, NULL);
	close(fd);
	g_nlisteners--;
	g_st[SKIFF_ST_SC_LISTENERS] = (uint64_t)g_nlisteners;
}

static int reply(int lfd, int32_t error, uint32_t flags)
{
	memset(g_resp, 0, g_sizes.seccomp_notif_resp);
	g_resp->id = g_req->id;
	g_resp->error = error;
	g_resp->flags = flags;
	return ioctl(lfd, SECCOMP_IOCTL_NOTIF_SEND, g_resp);
}

/* A message from skiffd: a listener to serve. */
static void control(void)
{
	for (;;) {
		uint8_t op;
		struct iovec iov = { &op, 1 };
		union skiff_fds_cmsg u;
		struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1 };
		skiff_expect_fds(&m, &u, 1);
		ssize_t r = recvmsg(g_ctl, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		if (r < 0 && (errno == EAGAIN || errno == EINTR))
			return;
		if (r <= 0) {
			/* skiffd holds the other end for as long as the broker runs; a
			 * restarted skiffd takes the broker's copy of it back */
			LOG("control socket closed");
			epoll_ctl(g_ep, EPOLL_CTL_DEL, g_ctl, NULL);
			return;
		}
		int fd = -1;
		int n = skiff_received_fds(&m, &fd, 1);
		if (r != 1 || op != SKIFF_CTL_LISTENER || n != 1 || (m.msg_flags & MSG_CTRUNC) || !is_listener(fd) ||
		    g_nlisteners >= MAX_LISTENERS) {
			if (n == 1)
				close(fd);
			st_add(SKIFF_ST_ERRORS, 1);
			LOG("control: refused a message (op 0x%02x, %d fds, %d listeners held)", op, n, g_nlisteners);
			continue;
		}
		struct epoll_event ev = { .events = EPOLLIN, .data.fd = fd };
		if (epoll_ctl(g_ep, EPOLL_CTL_ADD, fd, &ev) < 0) {
			st_add(SKIFF_ST_ERRORS, 1);
			LOG("control: epoll: %s", strerror(errno));
			close(fd);
			continue;
		}
		g_nlisteners++;
		g_st[SKIFF_ST_SC_LISTENERS] = (uint64_t)g_nlisteners;
		if (g_inflight) {   /* left by the broker before: continue it, if it is this listener's */
			g_req->id = g_inflight;
			if (reply(fd, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE) == 0) {
				LOG("continued notification %llx the previous broker left", (unsigned long long)g_inflight);
				g_inflight = 0;
			}
		}
		LOG("seccomp listener fd %d, %d held", fd, g_nlisteners);
	}
}

static int getint(int fd, int level, int name)
{
	int v = -1;
	socklen_t l = sizeof v;
	return getsockopt(fd, level, name, &v, &l) < 0 ? -1 : v;
}

/* The options copied from the caller's socket, in sks_optset's bit order. */
struct opt { int level, name; socklen_t len; };
static const struct opt g_opts[] = {
#define OPT(l, n, len) { l, n, len },
	SKS_OPTSET(OPT)
#undef OPT
};
#define NOPTS (int)(sizeof g_opts / sizeof g_opts[0])
_Static_assert(NOPTS <= 32, "sks_optset is 32 bits");
static char g_fresh[NOPTS][16];
static int g_fresh_known;

static int copy_option(int s, int h, int i)
{
	char v[16] = { 0 };
	socklen_t l = g_opts[i].len;
	if (getsockopt(s, g_opts[i].level, g_opts[i].name, v, &l) < 0)
		return 0;
	if (g_opts[i].level == SOL_TCP && g_opts[i].name == TCP_CONGESTION)
		l = strnlen(v, sizeof v);
	if (g_opts[i].level == SOL_SOCKET && (g_opts[i].name == SO_RCVBUF || g_opts[i].name == SO_SNDBUF))
		*(int *)v /= 2;   /* reads back doubled */
	return setsockopt(h, g_opts[i].level, g_opts[i].name, v, l) < 0 ? errno : 0;
}

/* Copies the options the program set on s to h. Returns 0, or the errno of
 * one h refused (the layer's setsockopt hook: the fast path does not carry
 * it). The layer records which options a socket set (sks_optset); where it
 * cannot answer, every option that differs from a fresh socket's is
 * copied. */
static int copy_options(int s, int h)
{
	uint32_t set = 0;
	socklen_t sl = sizeof set;
	if (getsockopt(s, SKS_OPTSET_LEVEL, SKS_OPTSET_NAME, &set, &sl) == 0 && sl == sizeof set) {
		for (int i = 0; set && i < NOPTS; i++, set >>= 1) {
			int err = set & 1 ? copy_option(s, h, i) : 0;
			if (err)
				return err;
		}
		return 0;
	}
	if (!g_fresh_known) {
		int f = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		for (int i = 0; f >= 0 && i < NOPTS; i++) {
			socklen_t l = g_opts[i].len;
			getsockopt(f, g_opts[i].level, g_opts[i].name, g_fresh[i], &l);
		}
		if (f >= 0)
			close(f);
		g_fresh_known = f >= 0;
	}
	for (int i = 0; i < NOPTS; i++) {
		char v[16] = { 0 };
		socklen_t l = g_opts[i].len;
		if (getsockopt(s, g_opts[i].level, g_opts[i].name, v, &l) < 0 || !memcmp(v, g_fresh[i], g_opts[i].len))
			continue;
		int err = copy_option(s, h, i);
		if (err)
			return err;
	}
	return 0;
}

/* Whether s (the target's fd n) is registered in one of the target's
 * epoll instances: a swap would lose the registration. The target's epoll
 * fds are looked up once a second per process. */
static int in_epoll(pid_t pid, int n)
{
	static pid_t cached;
	static uint64_t at;
	static int eps[32], neps;
	uint64_t t = now_ns();
	if (pid != cached || t - at > 1000000000ull) {
		char path[300], link[64];
		snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
		DIR *d = opendir(path);
		neps = 0;
		for (struct dirent *e; d && (e = readdir(d)) && neps < 32;) {
			if (e->d_name[0] == '.')
				continue;
			snprintf(path, sizeof path, "/proc/%d/fd/%s", (int)pid, e->d_name);
			ssize_t l = readlink(path, link, sizeof link - 1);
			if (l > 0 && (link[l] = 0, !strcmp(link, "anon_inode:[eventpoll]")))
				eps[neps++] = atoi(e->d_name);
		}
		if (d)
			closedir(d);
		cached = pid;
		at = t;
	}
	for (int i = 0; i < neps; i++) {
		struct kcmp_epoll_slot slot = { .efd = (uint32_t)eps[i], .tfd = (uint32_t)n, .toff = 0 };
		if (syscall(SYS_kcmp, pid, pid, KCMP_EPOLL_TFD, n, &slot) == 0)
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

enum outcome { PASSED, FALLBACK, REPLACED, DROPPED };

/* The target's socket n, if it is a TCP/IPv4 socket of the container's
 * namespace that has not connected, with where it is bound in *bound; else
 * -1 and *out says what to count. */
static int target_socket(pid_t pid, int n, struct sockaddr_in *bound, enum outcome *out)
{
	*out = PASSED;
	int pidfd = syscall(SYS_pidfd_open, pid, PIDFD_THREAD);
	if (pidfd < 0 && errno == EINVAL)
		pidfd = syscall(SYS_pidfd_open, pid, 0);
	if (pidfd < 0) {
		*out = DROPPED;
		return -1;
	}
	int s = syscall(SYS_pidfd_getfd, pidfd, n, 0);
	close(pidfd);
	if (s < 0)
		return -1;   /* not an fd: the kernel answers EBADF */
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
	    getsockopt(s, SOL_SOCKET, SO_NETNS_COOKIE, &ns, &l) < 0 || ns != g_container_netns ||
	    getsockopt(s, SOL_TCP, TCP_INFO, &ti, &tl) < 0 || ti.tcpi_state != TCP_CLOSE) {
		close(s);
		return -1;
	}
	*out = FALLBACK;
	if (in_epoll(pid, n)) {
		close(s);
		return -1;
	}
	return s;
}

/* Puts h at the target's fd n in place of s (closing s there). */
static int swap_in(int lfd, pid_t pid, int n, int s, int h)
{
	int fl = fcntl(s, F_GETFL);
	if (fl < 0 || fcntl(h, F_SETFL, fl & O_NONBLOCK) < 0)
		return -1;
	/* n is still s: the target did not close and reuse it meanwhile */
	if (syscall(SYS_kcmp, pid, getpid(), KCMP_FILE, n, s) != 0)
		return -1;
	struct seccomp_notif_addfd add = { .id = g_req->id, .flags = SECCOMP_ADDFD_FLAG_SETFD, .srcfd = (uint32_t)h,
					   .newfd = (uint32_t)n, .newfd_flags = cloexec(pid, n) ? O_CLOEXEC : 0 };
	return ioctl(lfd, SECCOMP_IOCTL_NOTIF_ADDFD, &add) == n ? 0 : -1;
}

static enum outcome on_connect(int lfd)
{
	pid_t pid = (pid_t)g_req->pid;
	int n = (int)g_req->data.args[0];
	struct sockaddr_in sa;
	struct iovec local = { &sa, sizeof sa }, remote = { (void *)(uintptr_t)g_req->data.args[1], sizeof sa };
	if (process_vm_readv(pid, &local, 1, &remote, 1, 0) != (ssize_t)sizeof sa)
		return reply(lfd, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE), PASSED;
	if (ioctl(lfd, SECCOMP_IOCTL_NOTIF_ID_VALID, &g_req->id) < 0)
		return DROPPED;
	uint32_t ip = sa.sin_addr.s_addr;
	if (sa.sin_family != AF_INET || ((ip & g_mask) != g_net && (ntohl(ip) >> 24) != 127))
		return reply(lfd, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE), PASSED;
	enum outcome out;
	struct sockaddr_in b;
	int s = target_socket(pid, n, &b, &out), h = -1;
	if (s < 0)
		return out == DROPPED ? DROPPED : (reply(lfd, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE), out);
	/* a socket bound first, or with an option the fast path refuses, or a
	 * connect the layer refuses, stays the container's (the overlay);
	 * another error the container's socket meets by itself */
	out = FALLBACK;
	if (!b.sin_port && !b.sin_addr.s_addr && (h = pool_take()) >= 0 && !copy_options(s, h) && fcntl(h, F_SETFL, O_NONBLOCK) == 0 &&
	    (connect(h, (struct sockaddr *)&sa, sizeof sa) == 0 || errno == EINPROGRESS))
		out = swap_in(lfd, pid, n, s, h) == 0 ? REPLACED : errno == ENOENT ? DROPPED : FALLBACK;
	int blocking = !(fcntl(s, F_GETFL) & O_NONBLOCK);
	if (out == REPLACED && !blocking)
		reply(lfd, -EINPROGRESS, 0);
	else if (out != DROPPED)
		/* blocking: the kernel's connect on the connecting socket waits
		 * for the handshake and returns its result */
		reply(lfd, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE);
	/* after the answer: the last reference to the container's socket
	 * goes here, and releasing it takes microseconds */
	close(s);
	if (h >= 0)
		close(h);
	return out;
}

static int on_lo(int fd)
{
	return getint(fd, SOL_SOCKET, SO_BINDTOIFINDEX) == 1;
}

static enum outcome on_listen(int lfd)
{
	pid_t pid = (pid_t)g_req->pid;
	int n = (int)g_req->data.args[0], backlog = (int)g_req->data.args[1];
	enum outcome out;
	struct sockaddr_in b;
	int s = target_socket(pid, n, &b, &out), h = -1;
	if (s >= 0) {
		out = FALLBACK;
		const char *why = NULL;
		struct sockaddr_in any = { .sin_family = AF_INET };
		int err;
		if (b.sin_addr.s_addr != INADDR_ANY && b.sin_addr.s_addr != g_ip)
			why = "bound to another address";
		else if (getint(s, SOL_SOCKET, SO_REUSEPORT) != 0)
			why = "SO_REUSEPORT (the kernel shares the port in the container's namespace)";
		else if ((h = pool_take()) < 0)
			why = "no host socket";
		else if ((err = copy_options(s, h)))
			why = "an option the fast path refuses";
		else if ((any.sin_port = b.sin_port, bind(h, (struct sockaddr *)&any, sizeof any) < 0))
			why = "bind refused";
		else if ((err = make_transparent(h)))
			why = "not made transparent";
		else if (listen(h, backlog) < 0)
			why = "listen refused";
		else if (on_lo(h))
			why = "not publishable (left on lo)";
		else if (swap_in(lfd, pid, n, s, h) < 0)
			out = errno == ENOENT ? DROPPED : FALLBACK, why = "swap failed";
		else
			out = REPLACED;
		if (why)
			LOG("seccomp: listen(%d) of pid %d stays on the overlay: %s (%s)", n, (int)pid, why, strerror(errno));
		(void)err;
		close(s);
		if (h >= 0)
			close(h);
	}
	if (out == DROPPED)
		return DROPPED;
	if (out == REPLACED)
		return reply(lfd, 0, 0), REPLACED;
	return reply(lfd, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE), out;
}

static void serve(int lfd)
{
	memset(g_req, 0, g_sizes.seccomp_notif);
	if (ioctl(lfd, SECCOMP_IOCTL_NOTIF_RECV, g_req) < 0)
		return;   /* the target went (ENOENT), or a signal */
	uint64_t t0 = now_ns();
	g_st[SKIFF_ST_SC_INFLIGHT] = g_req->id;
	enum outcome out = PASSED;
#ifdef NATIVE_ARCH
	if (g_keeper)
		reply(lfd, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE);
	else if (g_req->data.arch == NATIVE_ARCH && g_req->data.nr == SYS_connect)
		out = on_connect(lfd);
	else if (g_req->data.arch == NATIVE_ARCH && g_req->data.nr == SYS_listen)
		out = on_listen(lfd);
	else
#endif
		reply(lfd, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE);
	static const int slot[] = { [PASSED] = SKIFF_ST_SC_PASSED, [FALLBACK] = SKIFF_ST_SC_FALLBACK,
				    [REPLACED] = SKIFF_ST_SC_REPLACED, [DROPPED] = SKIFF_ST_SC_DROPPED };
	st_add(slot[out], 1);
	st_add(SKIFF_ST_SC_NS, now_ns() - t0);
	st_add(SKIFF_ST_SC_HANDLED, 1);
	g_st[SKIFF_ST_SC_INFLIGHT] = 0;
}

void sc_ready(void)
{
	struct epoll_event evs[16];
	int n = epoll_wait(g_ep, evs, 16, 0);
	for (int i = 0; i < n; i++) {
		int fd = evs[i].data.fd;
		if (fd == g_ctl)
			control();
		else if (evs[i].events & EPOLLIN)
			serve(fd);
		else if (evs[i].events & (EPOLLHUP | EPOLLERR))
			drop_listener(fd);   /* no process uses the filter any more */
	}
}
