/* hooks.c - libskiff.so, the LD_PRELOAD shim of skiff's sockets layer: the
 * libc functions it interposes.
 *
 * socket(AF_INET, SOCK_STREAM, 0|IPPROTO_TCP) returns a socket that lives in
 * the HOST netns, sent by skiff-broker ahead of demand, in batches, over the
 * abstract unix socket "\0skiff-broker" of the container netns (client.c).
 * While such a socket is "fresh" (not yet connected/bound/listening) the shim
 * can still swap it for an ordinary container-netns socket (dup3 onto the
 * same fd number, recorded setsockopts replayed: fdtab.c) whenever the fast
 * path does not apply or the kernel refuses it.  See README.md for the rules.
 *
 * Every failure of the replacement machinery degrades to a plain socket in the
 * container netns.  errno seen by the caller is always the one of the call the
 * caller asked for.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "shim.h"
#include "skiff_broker.h"

#define EXPORT __attribute__((visibility("default")))
#define TLS __thread __attribute__((tls_model("initial-exec")))

/* ---------- real functions ---------- */
/* libc's, resolved once (RTLD_NEXT) */
static struct {
	int (*socket)(int, int, int);
	int (*connect)(int, const struct sockaddr *, socklen_t);
	int (*bind)(int, const struct sockaddr *, socklen_t);
	int (*listen)(int, int);
	int (*setsockopt)(int, int, int, const void *, socklen_t);
	int (*close)(int);
	int (*dup)(int);
	int (*dup2)(int, int);
	int (*dup3)(int, int, int);
	int (*fcntl)(int, int, ...);
	int (*fcntl64)(int, int, ...);
	int (*epoll_ctl)(int, int, int, struct epoll_event *);
	ssize_t (*read)(int, void *, size_t);
	ssize_t (*readv)(int, const struct iovec *, int);
	ssize_t (*recv)(int, void *, size_t, int);
	ssize_t (*recvfrom)(int, void *, size_t, int, struct sockaddr *, socklen_t *);
	ssize_t (*recvmsg)(int, struct msghdr *, int);
	ssize_t (*read_chk)(int, void *, size_t, size_t);
	ssize_t (*recv_chk)(int, void *, size_t, size_t, int);
	ssize_t (*recvfrom_chk)(int, void *, size_t, size_t, int, struct sockaddr *, socklen_t *);
} real;

static void *sym(const char *name)
{
	return dlsym(RTLD_NEXT, name);
}

static void resolve(void)
{
	/* idempotent; benign if two threads race here */
	if (!real.connect) real.connect = sym("connect");
	if (!real.bind) real.bind = sym("bind");
	if (!real.listen) real.listen = sym("listen");
	if (!real.setsockopt) real.setsockopt = sym("setsockopt");
	if (!real.close) real.close = sym("close");
	if (!real.dup) real.dup = sym("dup");
	if (!real.dup2) real.dup2 = sym("dup2");
	if (!real.dup3) real.dup3 = sym("dup3");
	if (!real.fcntl) real.fcntl = sym("fcntl");
	if (!real.fcntl64) real.fcntl64 = sym("fcntl64");
	if (!real.fcntl64) real.fcntl64 = real.fcntl;
	if (!real.epoll_ctl) real.epoll_ctl = sym("epoll_ctl");
	if (!real.read) real.read = sym("read");
	if (!real.readv) real.readv = sym("readv");
	if (!real.recv) real.recv = sym("recv");
	if (!real.recvfrom) real.recvfrom = sym("recvfrom");
	if (!real.recvmsg) real.recvmsg = sym("recvmsg");
	if (!real.read_chk) real.read_chk = sym("__read_chk");
	if (!real.recv_chk) real.recv_chk = sym("__recv_chk");
	if (!real.recvfrom_chk) real.recvfrom_chk = sym("__recvfrom_chk");
	if (!real.socket) real.socket = sym("socket");   /* last: used as "resolved" marker */
}
#define RESOLVE(p) do { if (__builtin_expect(!(p), 0)) resolve(); } while (0)

/* ---------- state ---------- */
static volatile int enabled;     /* set by the constructor; 0 before it ran or if opted out */
static TLS int t_inshim;         /* the re-entrancy guard (shim.h) */

int shim_enter(void) { int p = t_inshim; t_inshim = 1; return p; }
void shim_leave(int prev) { t_inshim = prev; }

/* Is fd still the host socket its table entry says?  A host-netns TCP socket
 * in state (TCP_CLOSE: neither connected nor listening; only the shim gives
 * the app those).  Checked before the shim replaces an fd, never per call. */
static int own_host_socket(int fd, int state)
{
	uint64_t ns = 0, host = client_hello()->host_netns;
	socklen_t nl = sizeof ns;
	struct tcp_info ti;
	socklen_t tl = sizeof ti;
	return host && getsockopt(fd, SOL_SOCKET, SO_NETNS_COOKIE, &ns, &nl) == 0 && ns == host &&
	       getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &tl) == 0 && ti.tcpi_state == state;
}

/* ---------- fallback: swap to a container socket ---------- */
static int is_fallback_errno(int e)
{
	return e == EPERM || e == EACCES || e == EADDRNOTAVAIL || e == ENETUNREACH || e == EHOSTUNREACH;
}

#define NOT_OURS (-2)

/* Replace fd (a fresh/bound host socket, or a listening one: ST_LISTENING) by
 * a container-netns socket with the same fd number, options, bind address,
 * O_NONBLOCK and FD_CLOEXEC.  Consumes e.
 * Returns 0; -1 with errno set (fd unchanged); or NOT_OURS if the entry was
 * stale (the caller then passes the app's call through). */
static int swap_to_container(int fd, struct fdent *e, int reason)
{
	if (!own_host_socket(fd, e->state == ST_LISTENING ? TCP_LISTEN : TCP_CLOSE)) { ent_free(e); return NOT_OURS; }
	if (e->unreplayable) { ent_free(e); errno = EPERM; return -1; }
	int s = real.socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (s < 0 && errno == EMFILE) {
		/* the swap needs one more fd: the pool's are the app's first */
		client_drop_pool();
		s = real.socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	}
	if (s < 0) { int er = errno; ent_free(e); errno = er; return -1; }
	for (int i = 0; i < e->nopts; i++)
		real.setsockopt(s, e->opts[i].level, e->opts[i].name, e->opts[i].val, e->opts[i].len);
	int fl = sys_fcntl(fd, F_GETFL, 0), fdfl = sys_fcntl(fd, F_GETFD, 0);
	int er = 0;
	if (fl < 0 || fdfl < 0) er = errno;
	else if (e->has_bind && real.bind(s, (const struct sockaddr *)&e->bindaddr, sizeof e->bindaddr) < 0) er = errno;
	else if ((fl & O_NONBLOCK) && sys_fcntl(s, F_SETFL, O_NONBLOCK) < 0) er = errno;
	else if (sys_dup3(s, fd, (fdfl & FD_CLOEXEC) ? O_CLOEXEC : 0) < 0) er = errno;
	sys_close(s);
	/* the dup3 closed the host socket, and with it its registrations */
	for (int i = 0; !er && real.epoll_ctl && i < e->neps; i++)
		real.epoll_ctl(e->eps[i].epfd, EPOLL_CTL_ADD, fd, &e->eps[i].ev);
	ent_free(e);
	if (er) { errno = er; return -1; }
	client_count_fallback(reason);
	return 0;
}

static int fast_dest(const struct sockaddr *sa, socklen_t len)
{
	const struct hello_info *h = client_hello();
	if (len < sizeof(struct sockaddr_in) || sa->sa_family != AF_INET || !h->have) return 0;
	return skiff_fast_ip(((const struct sockaddr_in *)sa)->sin_addr.s_addr, h->net, h->mask);
}

/* connect() and listen() as the shim makes them: with skiff's seccomp tag in
 * the descriptor argument, so that a process also under skiff's seccomp
 * profile is not notified (the shim serves its sockets itself, and a
 * container socket it kept is the overlay's). Raw syscalls, which, unlike
 * libc's, are no thread cancellation points. */
static int t_connect(int fd, const struct sockaddr *sa, socklen_t len)
{
	return (int)syscall(SYS_connect, (long)((unsigned long)fd | SKIFF_SECCOMP_TAG), sa, (long)len);
}

static int t_listen(int fd, int backlog)
{
	return (int)syscall(SYS_listen, (long)((unsigned long)fd | SKIFF_SECCOMP_TAG), (long)backlog);
}

/* ---------- interposed functions ---------- */
EXPORT int socket(int domain, int type, int protocol)
{
	RESOLVE(real.socket);
	int base = type & ~(SOCK_NONBLOCK | SOCK_CLOEXEC);
	if (!enabled || t_inshim || domain != AF_INET || base != SOCK_STREAM ||
	    (protocol != 0 && protocol != IPPROTO_TCP))
		return real.socket(domain, type, protocol);
	int saved = errno;
	t_inshim = 1;
	int fd = client_take_socket(type);
	if (fd >= 0 && tab_track_fresh(fd) < 0) {
		sys_close(fd);
		fd = -1;
	}
	t_inshim = 0;
	if (fd >= 0) { errno = saved; return fd; }
	client_count_fallback(SKIFF_R_UNAVAILABLE);
	errno = saved;
	return real.socket(domain, type, protocol);
}

EXPORT int connect(int fd, const struct sockaddr *sa, socklen_t len)
{
	RESOLVE(real.connect);
	if (t_inshim || !sa) return t_connect(fd, sa, len);
	struct fdent *e = tab_take(fd);
	if (!e) return t_connect(fd, sa, len);
	int r, er;
	if (fast_dest(sa, len)) {
		r = t_connect(fd, sa, len);
		er = errno;
		if (r == 0 || !is_fallback_errno(er)) {
			if (r == 0 || er == EINPROGRESS) client_count_replaced();
			if (r < 0 && (er == EINVAL || er == EFAULT || er == EAFNOSUPPORT))
				tab_put(fd, e);   /* nothing happened to the socket */
			else
				ent_free(e);      /* connected/connecting/failed: no longer fresh */
			errno = er;
			return r;
		}
		if (swap_to_container(fd, e, SKIFF_R_CONNECT) < 0) { errno = er; return -1; }
	} else if (swap_to_container(fd, e, SKIFF_R_DEST) == -1) {
		return -1;
	}
	return t_connect(fd, sa, len);
}

EXPORT int bind(int fd, const struct sockaddr *sa, socklen_t len)
{
	RESOLVE(real.bind);
	if (t_inshim || !sa) return real.bind(fd, sa, len);
	struct fdent *e = tab_take(fd);
	if (!e) return real.bind(fd, sa, len);
	if (e->state != ST_FRESH) { tab_put(fd, e); return real.bind(fd, sa, len); }
	if (len >= sizeof(struct sockaddr_in) && sa->sa_family == AF_INET) {
		uint32_t ip = ((const struct sockaddr_in *)sa)->sin_addr.s_addr;
		if (ip == INADDR_ANY || (client_hello()->have && ip == client_hello()->ip)) {
			int r = real.bind(fd, sa, len), er = errno;
			if (r == 0) {
				e->state = ST_BOUND;
				e->has_bind = 1;
				memcpy(&e->bindaddr, sa, sizeof e->bindaddr);
				tab_put(fd, e);
				errno = er;
				return 0;
			}
			if (!is_fallback_errno(er) || er == ENETUNREACH || er == EHOSTUNREACH) {
				tab_put(fd, e);   /* e.g. EADDRINUSE: still fresh, app may retry */
				errno = er;
				return r;
			}
			if (swap_to_container(fd, e, SKIFF_R_BIND) < 0) { errno = er; return -1; }
			return real.bind(fd, sa, len);
		}
	}
	if (swap_to_container(fd, e, SKIFF_R_BIND) == -1) return -1;
	return real.bind(fd, sa, len);
}

EXPORT int listen(int fd, int backlog)
{
	RESOLVE(real.listen);
	if (t_inshim) return t_listen(fd, backlog);
	struct fdent *e = tab_take(fd);
	if (!e) return t_listen(fd, backlog);
	if (e->state == ST_FRESH) {
		/* never autobind a host socket to 0.0.0.0: explicit bind lets the hook move it to 127.0.0.1 */
		struct sockaddr_in any = { .sin_family = AF_INET };
		if (real.bind(fd, (struct sockaddr *)&any, sizeof any) < 0) {
			if (swap_to_container(fd, e, SKIFF_R_LISTEN) == -1) return -1;
			return t_listen(fd, backlog);
		}
		e->state = ST_BOUND;
		e->has_bind = 1;
		e->bindaddr = any;
	}
	if (!e->transparent && client_transparent(fd) < 0) {
		/* unreachable over the overlay: a container listener is the overlay's */
		if (swap_to_container(fd, e, SKIFF_R_LISTEN) == -1) return -1;
		return t_listen(fd, backlog);
	}
	e->transparent = 1;   /* a listen() that fails may be tried again */
	int r = t_listen(fd, backlog), er = errno;
	if (r < 0) { tab_put(fd, e); errno = er; return r; }
	if (!skiff_on_lo(fd)) { client_count_replaced(); ent_free(e); errno = er; return 0; }
	/* The layer could not publish it (a map full) and bound it to lo, where
	 * nothing reaches it: a listener of the container's own, which the
	 * overlay reaches. (Bound to lo by the app itself, outside secure mode,
	 * it is the container's lo the app meant.) */
	e->state = ST_LISTENING;
	if (swap_to_container(fd, e, SKIFF_R_LISTEN) == -1) return -1;
	return t_listen(fd, backlog);
}

EXPORT int setsockopt(int fd, int level, int name, const void *val, socklen_t len)
{
	RESOLVE(real.setsockopt);
	if (t_inshim || !tab_tracking()) return real.setsockopt(fd, level, name, val, len);
	int r = real.setsockopt(fd, level, name, val, len), er = errno;
	if (r == 0) {
		tab_record_opt(fd, level, name, val, len);   /* BOUND too: replayed if a connect swaps */
		errno = er;
		return 0;
	}
	struct fdent *e = er == EPERM ? tab_take(fd) : NULL;
	if (e && e->state == ST_FRESH) {
		if (swap_to_container(fd, e, SKIFF_R_SOCKOPT) < 0) { errno = er; return -1; }
		return real.setsockopt(fd, level, name, val, len);
	}
	if (e) tab_put(fd, e);
	errno = er;
	return r;
}

EXPORT int close(int fd)
{
	RESOLVE(real.close);
	if (!t_inshim && tab_tracking()) {
		int saved = errno;
		tab_clear(fd);   /* before closing: the number cannot be reused meanwhile */
		errno = saved;
	}
	return real.close(fd);
}

EXPORT int epoll_ctl(int epfd, int op, int fd, struct epoll_event *ev)
{
	RESOLVE(real.epoll_ctl);
	if (!real.epoll_ctl) { errno = ENOSYS; return -1; }
	int r = real.epoll_ctl(epfd, op, fd, ev);
	if (r == 0 && !t_inshim && tab_tracking()) {
		int saved = errno;
		tab_epoll(fd, epfd, op, ev);
		errno = saved;
	}
	return r;
}

EXPORT int dup(int fd)
{
	RESOLVE(real.dup);
	int r = real.dup(fd);
	if (r >= 0 && !t_inshim && tab_tracking()) { int s = errno; tab_dup(fd, r); errno = s; }
	return r;
}

EXPORT int dup2(int oldfd, int newfd)
{
	RESOLVE(real.dup2);
	int r = real.dup2(oldfd, newfd);
	if (r >= 0 && oldfd != newfd && !t_inshim && tab_tracking()) { int s = errno; tab_dup(oldfd, newfd); errno = s; }
	return r;
}

EXPORT int dup3(int oldfd, int newfd, int flags)
{
	RESOLVE(real.dup3);
	int r = real.dup3(oldfd, newfd, flags);
	if (r >= 0 && !t_inshim && tab_tracking()) { int s = errno; tab_dup(oldfd, newfd); errno = s; }
	return r;
}

static int fcntl_common(int (*fn)(int, int, ...), int fd, int cmd, void *arg)
{
	int r = fn(fd, cmd, arg);
	if (r >= 0 && (cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC) && !t_inshim && tab_tracking()) {
		int s = errno;
		tab_dup(fd, r);
		errno = s;
	}
	return r;
}

EXPORT int fcntl(int fd, int cmd, ...)
{
	RESOLVE(real.fcntl);
	va_list ap;
	va_start(ap, cmd);
	void *arg = va_arg(ap, void *);   /* int or pointer: same slot on all Linux ABIs glibc supports */
	va_end(ap);
	return fcntl_common(real.fcntl, fd, cmd, arg);
}

EXPORT int fcntl64(int fd, int cmd, ...)
{
	RESOLVE(real.fcntl64);
	va_list ap;
	va_start(ap, cmd);
	void *arg = va_arg(ap, void *);
	va_end(ap);
	return fcntl_common(real.fcntl64, fd, cmd, arg);
}

/* ---------- fork / init / exit ---------- */
/* The forking thread's t_inshim, kept while it holds both locks: a signal
 * handler that calls close() or socket() meanwhile must pass through (the
 * locks are its own thread's). */
static int fork_inshim;

static void atfork_prepare(void)
{
	int p = shim_enter();
	client_fork_lock();
	tab_fork_lock();
	fork_inshim = p;
}

static void atfork_parent(void)
{
	int p = fork_inshim;
	tab_fork_unlock();
	client_fork_unlock();
	shim_leave(p);
}

static void atfork_child(void)
{
	int p = fork_inshim;
	tab_fork_unlock();
	client_fork_child();
	shim_leave(p);
}

__attribute__((constructor)) static void skiff_init(void)
{
	resolve();
	const char *v = getenv("SKIFF_SOCKETS");
	if (v && (!strcmp(v, "off") || !strcmp(v, "0") || !strcmp(v, "false") || !strcmp(v, "no")))
		return;
	struct rlimit rl;
	unsigned long lim = 1024;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < lim)
		lim = rl.rlim_cur;
	client_init(getenv("SKIFF_BROKER"), lim);
	if (!real.socket || !real.connect || !real.bind || !real.listen || !real.setsockopt || !real.close ||
	    !real.dup || !real.dup2 || !real.dup3 || !real.fcntl)
		return;   /* cannot interpose safely: stay disabled */
	if (pthread_atfork(atfork_prepare, atfork_parent, atfork_child) != 0)
		return;
	enabled = 1;
}

__attribute__((destructor)) static void skiff_fini(void)
{
	if (!enabled || t_inshim) return;
	int saved = errno;
	client_flush();
	errno = saved;
}

/* ---------- reads on channelled sockets ----------
 * A blocking read of a socket the channels layer joined (an sk_msg
 * redirect) returns -1 EAGAIN on Linux 6.18 when the reader is woken
 * without data: by its own shutdown(SHUT_WR), or another thread's wait for
 * send space (docs/channels.md).  A blocking stream socket without a
 * receive timeout gives that answer to an ordinary read in no other case,
 * and programs take it for an error: the shim waits for input and reads
 * again.  Reads that may fail with EAGAIN by design keep it: MSG_DONTWAIT,
 * MSG_OOB (no urgent byte), MSG_ERRQUEUE (an empty error queue), a
 * non-blocking socket, SO_RCVTIMEO.  A signal during the wait ends it with
 * EINTR, as it would end the read.  Only a read that failed with EAGAIN
 * costs anything more. */
static int spurious_eagain(int fd, int flags)
{
	if (errno != EAGAIN || (flags & (MSG_DONTWAIT | MSG_OOB | MSG_ERRQUEUE))) return 0;
	int fl = sys_fcntl(fd, F_GETFL, 0), type = 0;
	struct timeval tv = {0};
	socklen_t tl = sizeof type, vl = sizeof tv;
	if (fl < 0 || (fl & O_NONBLOCK) || getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) != 0 || type != SOCK_STREAM ||
	    getsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, &vl) != 0 || tv.tv_sec || tv.tv_usec) {
		errno = EAGAIN;
		return 0;
	}
	struct pollfd p = {.fd = fd, .events = POLLIN};
	if (poll(&p, 1, -1) < 0)
		return 0; /* errno: EINTR (a signal), or poll's own failure */
	errno = EAGAIN;
	return 1;
}

#define RETRY_READ(fn, fd, flags, ...) do { \
	RESOLVE(fn); \
	if (!fn) { errno = ENOSYS; return -1; } \
	ssize_t got_; \
	while ((got_ = fn(fd, __VA_ARGS__)) < 0 && spurious_eagain(fd, flags)) \
		; \
	return got_; \
} while (0)

EXPORT ssize_t read(int fd, void *buf, size_t len) { RETRY_READ(real.read, fd, 0, buf, len); }
EXPORT ssize_t readv(int fd, const struct iovec *iov, int n) { RETRY_READ(real.readv, fd, 0, iov, n); }
EXPORT ssize_t recv(int fd, void *buf, size_t len, int flags) { RETRY_READ(real.recv, fd, flags, buf, len, flags); }
EXPORT ssize_t recvfrom(int fd, void *buf, size_t len, int flags, struct sockaddr *sa, socklen_t *sl)
{
	RETRY_READ(real.recvfrom, fd, flags, buf, len, flags, sa, sl);
}
EXPORT ssize_t recvmsg(int fd, struct msghdr *m, int flags) { RETRY_READ(real.recvmsg, fd, flags, m, flags); }
/* what programs built with _FORTIFY_SOURCE call */
EXPORT ssize_t __read_chk(int fd, void *buf, size_t len, size_t buflen) { RETRY_READ(real.read_chk, fd, 0, buf, len, buflen); }
EXPORT ssize_t __recv_chk(int fd, void *buf, size_t len, size_t buflen, int flags)
{
	RETRY_READ(real.recv_chk, fd, flags, buf, len, buflen, flags);
}
EXPORT ssize_t __recvfrom_chk(int fd, void *buf, size_t len, size_t buflen, int flags, struct sockaddr *sa, socklen_t *sl)
{
	RETRY_READ(real.recvfrom_chk, fd, flags, buf, len, buflen, flags, sa, sl);
}
