/* libskiff.so - LD_PRELOAD shim for skiff "sockets" mode.
 *
 * socket(AF_INET, SOCK_STREAM, 0|IPPROTO_TCP) returns a socket that lives in
 * the HOST netns, sent by skiff-broker ahead of demand, in batches, over the
 * abstract unix socket "\0skiff-broker" of the container netns.  The shim keeps
 * the batch at high fd numbers and moves one to the lowest free number per
 * socket() call.  While
 * such a socket is "fresh" (not yet connected/bound/listening) the shim can
 * still swap it for an ordinary container-netns socket (dup3 onto the same
 * fd number, recorded setsockopts replayed) whenever the fast path does not
 * apply or the kernel refuses it.  See README.md for the rules.
 *
 * Every failure of the replacement machinery degrades to a plain socket in the
 * container netns.  errno seen by the caller is always the one of the call the
 * caller asked for.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "skiff_broker.h"

#define EXPORT __attribute__((visibility("default")))
#define TLS __thread __attribute__((tls_model("initial-exec")))

#define BATCH       32      /* sockets per request (fewer under a small fd limit: g_batch) */
#define LOW_WATER   8       /* request the next batch when this few are still due ... */
#define LOW_WATER_MAX 56    /* ... or, after threads had to wait, up to this many */
#define WAIT_MS     500     /* max wait for a socket the broker owes */
#define RETRY_MS    1000    /* broker retry back-off */
#define SOPT_MAX    128     /* max recorded option value size */
#define NOPTS_MAX   32      /* max recorded options per fd */
#define NEPOLL_MAX  4       /* max recorded epoll registrations per fresh fd */

/* ---------- real functions ---------- */
static int (*r_socket)(int, int, int);
static int (*r_connect)(int, const struct sockaddr *, socklen_t);
static int (*r_bind)(int, const struct sockaddr *, socklen_t);
static int (*r_listen)(int, int);
static int (*r_setsockopt)(int, int, int, const void *, socklen_t);
static int (*r_close)(int);
static int (*r_dup)(int);
static int (*r_dup2)(int, int);
static int (*r_dup3)(int, int, int);
static int (*r_fcntl)(int, int, ...);
static int (*r_fcntl64)(int, int, ...);
static int (*r_epoll_ctl)(int, int, int, struct epoll_event *);
static ssize_t (*r_read)(int, void *, size_t);
static ssize_t (*r_readv)(int, const struct iovec *, int);
static ssize_t (*r_recv)(int, void *, size_t, int);
static ssize_t (*r_recvfrom)(int, void *, size_t, int, struct sockaddr *, socklen_t *);
static ssize_t (*r_recvmsg)(int, struct msghdr *, int);
static ssize_t (*r_read_chk)(int, void *, size_t, size_t);
static ssize_t (*r_recv_chk)(int, void *, size_t, size_t, int);
static ssize_t (*r_recvfrom_chk)(int, void *, size_t, size_t, int, struct sockaddr *, socklen_t *);

/* raw syscalls for the shim's own housekeeping: never interposed, never recurse */
static int sys_close(int fd) { return (int)syscall(SYS_close, fd); }
static int sys_fcntl(int fd, int cmd, long arg) { return (int)syscall(SYS_fcntl, fd, cmd, arg); }
static int sys_fstat(int fd, struct stat *st) { return (int)syscall(SYS_fstat, fd, st); }
static int sys_dup3(int o, int n, int fl) { return (int)syscall(SYS_dup3, o, n, fl); }

static void *sym(const char *name)
{
	return dlsym(RTLD_NEXT, name);
}

static void resolve(void)
{
	/* idempotent; benign if two threads race here */
	if (!r_connect) r_connect = sym("connect");
	if (!r_bind) r_bind = sym("bind");
	if (!r_listen) r_listen = sym("listen");
	if (!r_setsockopt) r_setsockopt = sym("setsockopt");
	if (!r_close) r_close = sym("close");
	if (!r_dup) r_dup = sym("dup");
	if (!r_dup2) r_dup2 = sym("dup2");
	if (!r_dup3) r_dup3 = sym("dup3");
	if (!r_fcntl) r_fcntl = sym("fcntl");
	if (!r_fcntl64) r_fcntl64 = sym("fcntl64");
	if (!r_fcntl64) r_fcntl64 = r_fcntl;
	if (!r_epoll_ctl) r_epoll_ctl = sym("epoll_ctl");
	if (!r_read) r_read = sym("read");
	if (!r_readv) r_readv = sym("readv");
	if (!r_recv) r_recv = sym("recv");
	if (!r_recvfrom) r_recvfrom = sym("recvfrom");
	if (!r_recvmsg) r_recvmsg = sym("recvmsg");
	if (!r_read_chk) r_read_chk = sym("__read_chk");
	if (!r_recv_chk) r_recv_chk = sym("__recv_chk");
	if (!r_recvfrom_chk) r_recvfrom_chk = sym("__recvfrom_chk");
	if (!r_socket) r_socket = sym("socket");   /* last: used as "resolved" marker */
}
#define RESOLVE(p) do { if (__builtin_expect(!(p), 0)) resolve(); } while (0)

/* ---------- global state ---------- */
static volatile int g_enabled;   /* set by the constructor; 0 before it ran or if opted out */
static char g_name[sizeof(((struct sockaddr_un *)0)->sun_path)] = SKIFF_BROKER_NAME;
static int g_hibase = 768;       /* the broker connection and the pool live at >= this */
static int g_batch = BATCH;      /* sockets per request: the pool fits above g_hibase */

static TLS int t_inshim;         /* re-entrancy guard (signal handler calling us while we hold a lock) */

/* broker connection, under g_broker_mu */
static pthread_mutex_t g_broker_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_bfd = -1;
static dev_t g_bdev;
static ino_t g_bino;
static int g_nreq;                 /* batches asked for and not yet received */
static int g_low_water = LOW_WATER; /* doubles each time a socket() had to wait */
static int g_primed;               /* a batch came over this connection (its first is no burst) */
/* the pool: received host sockets not yet handed out, at >= g_hibase (its
 * number and cookie, to tell it from a file the app put there) */
struct pooled { int fd; uint64_t cookie; };
static struct pooled g_pool[BATCH];
static int g_npool;
static uint64_t g_retry_at;        /* ms, CLOCK_MONOTONIC: do not ask the broker before */
/* cluster config from the hello (written under g_broker_mu, read racily: it only changes on reconnect) */
static volatile uint32_t g_net, g_mask, g_ip;
static volatile uint64_t g_host_netns;
static volatile int g_have_hello;

/* counters not yet reported to the broker */
static uint32_t g_cnt_replaced, g_cnt_fallback;

/* per-fd state, under g_tab_mu */
enum { ST_FRESH = 1, ST_BOUND = 2, ST_LISTENING = 3 };
struct sopt { int level, name; socklen_t len; unsigned char val[SOPT_MAX]; };
/* An epoll registration of the fd: a fallback's dup3 ends it with the host
 * socket, and gives it to the container socket. */
struct epreg { int epfd; struct epoll_event ev; };
struct fdent {
	int state;
	int unreplayable;          /* an option or registration we could not record */
	int has_bind;
	int transparent;           /* the broker made it IP_TRANSPARENT */
	struct sockaddr_in bindaddr;
	int nopts, capopts;
	struct sopt *opts;
	int neps;
	struct epreg eps[NEPOLL_MAX];
};
static pthread_mutex_t g_tab_mu = PTHREAD_MUTEX_INITIALIZER;
static struct fdent **g_tab;       /* mmap'd */
static int g_tabsz;
static int g_ntracked;             /* atomic; 0 lets close()/dup() skip the lock */

static uint64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static int tracked_possible(void) { return __atomic_load_n(&g_ntracked, __ATOMIC_RELAXED) > 0; }

/* Lock helpers also raise the re-entrancy guard, so a signal handler that
 * calls close()/socket() while this thread holds a lock passes straight
 * through instead of deadlocking (a stale table entry is caught before the
 * shim acts on its fd: own_host_socket()). */
static int tab_lock(void) { int p = t_inshim; t_inshim = 1; pthread_mutex_lock(&g_tab_mu); return p; }
static void tab_unlock(int p) { pthread_mutex_unlock(&g_tab_mu); t_inshim = p; }
static int broker_lock(void) { int p = t_inshim; t_inshim = 1; pthread_mutex_lock(&g_broker_mu); return p; }
static void broker_unlock(int p) { pthread_mutex_unlock(&g_broker_mu); t_inshim = p; }

/* ---------- memory (caller holds g_tab_mu) ----------
 * The table's memory comes from mmap, never malloc: close(), dup() and
 * socket() are async-signal-safe, and a handler may call them while the
 * thread it interrupted is inside malloc, holding its lock (`sockcheck
 * sigmalloc`). Blocks of 2^k bytes, 128 B to 8 KiB, each size on a free list
 * of its own, carved from 64 KiB chunks and never given back: the shim's
 * memory is its peak of fresh sockets. */
#define MEM_MIN_SHIFT 7
#define MEM_CLASSES   7
#define MEM_CHUNK     (64 * 1024)
static void *g_mem_free[MEM_CLASSES];
static char *g_chunk;
static size_t g_chunk_left;

static void *mem_map(size_t n)
{
	void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	return p == MAP_FAILED ? NULL : p;
}

static int mem_class(size_t n)
{
	int k = 0;
	while (k < MEM_CLASSES && ((size_t)1 << (MEM_MIN_SHIFT + k)) < n) k++;
	return k;
}

/* n zeroed bytes, or NULL */
static void *mem_get(size_t n)
{
	int k = mem_class(n);
	if (k == MEM_CLASSES) return NULL;
	size_t sz = (size_t)1 << (MEM_MIN_SHIFT + k);
	void *p = g_mem_free[k];
	if (p) {
		g_mem_free[k] = *(void **)p;
		return memset(p, 0, sz);
	}
	if (g_chunk_left < sz) {
		char *c = mem_map(MEM_CHUNK);   /* the old chunk's tail, < 8 KiB, is lost */
		if (!c) return NULL;
		g_chunk = c;
		g_chunk_left = MEM_CHUNK;
	}
	p = g_chunk;   /* fresh from mmap: zero */
	g_chunk += sz;
	g_chunk_left -= sz;
	return p;
}

/* gives back a block mem_get(n) returned */
static void mem_put(void *p, size_t n)
{
	if (!p) return;
	int k = mem_class(n);
	*(void **)p = g_mem_free[k];
	g_mem_free[k] = p;
}

/* ---------- fd table ---------- */
/* caller holds g_tab_mu */
static void ent_release_locked(struct fdent *e)
{
	if (!e) return;
	mem_put(e->opts, (size_t)e->capopts * sizeof *e->opts);
	mem_put(e, sizeof *e);
}

/* caller holds g_tab_mu; a cleared entry, or NULL */
static struct fdent *ent_new_locked(void) { return mem_get(sizeof(struct fdent)); }

static void ent_free(struct fdent *e)
{
	if (!e) return;
	int p = tab_lock();
	ent_release_locked(e);
	tab_unlock(p);
}

/* caller holds g_tab_mu */
static struct fdent *tab_detach_locked(int fd)
{
	if (fd < 0 || fd >= g_tabsz || !g_tab[fd]) return NULL;
	struct fdent *e = g_tab[fd];
	g_tab[fd] = NULL;
	__atomic_sub_fetch(&g_ntracked, 1, __ATOMIC_RELAXED);
	return e;
}

/* caller holds g_tab_mu; takes ownership of e (releases it on failure) */
static void tab_put_locked(int fd, struct fdent *e)
{
	if (fd < 0) { ent_release_locked(e); return; }
	if (fd >= g_tabsz) {
		int nsz = g_tabsz ? g_tabsz : 256;
		while (nsz <= fd) nsz *= 2;
		struct fdent **t = mem_map(nsz * sizeof *t);
		if (!t) { ent_release_locked(e); return; }   /* OOM: fd stays an untracked host socket */
		if (g_tab) {
			memcpy(t, g_tab, g_tabsz * sizeof *t);
			munmap(g_tab, g_tabsz * sizeof *t);
		}
		g_tab = t;
		g_tabsz = nsz;
	}
	ent_release_locked(tab_detach_locked(fd));
	g_tab[fd] = e;
	__atomic_add_fetch(&g_ntracked, 1, __ATOMIC_RELAXED);
}

static void tab_put(int fd, struct fdent *e)
{
	int p = tab_lock();
	tab_put_locked(fd, e);
	tab_unlock(p);
}

/* Take fd's entry out of the table (the caller owns it while it works on the
 * fd, so no lock is held across blocking calls).  Returns NULL if the fd is not
 * tracked.  The entry may be stale (the fd was closed behind our back, e.g. by
 * close_range/fclose, and the number now holds another file): passing the
 * app's calls through is harmless then, and own_host_socket() guards the rest. */
static struct fdent *tab_take(int fd)
{
	if (!tracked_possible()) return NULL;
	int p = tab_lock();
	struct fdent *e = tab_detach_locked(fd);
	tab_unlock(p);
	return e;
}

/* Is fd still the host socket its table entry says?  A host-netns TCP socket
 * in state (TCP_CLOSE: neither connected nor listening; only the shim gives
 * the app those).  Checked before the shim replaces an fd, never per call. */
static int own_host_socket(int fd, int state)
{
	uint64_t ns = 0;
	socklen_t nl = sizeof ns;
	struct tcp_info ti;
	socklen_t tl = sizeof ti;
	return g_host_netns && getsockopt(fd, SOL_SOCKET, SO_NETNS_COOKIE, &ns, &nl) == 0 && ns == g_host_netns &&
	       getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &tl) == 0 && ti.tcpi_state == state;
}

static void tab_clear(int fd)
{
	if (!tracked_possible()) return;
	int p = tab_lock();
	struct fdent *e = tab_detach_locked(fd);
	tab_unlock(p);
	ent_free(e);
}

/* caller holds g_tab_mu */
static struct fdent *ent_clone_locked(const struct fdent *s)
{
	struct fdent *e = ent_new_locked();
	if (!e) return NULL;
	*e = *s;
	e->opts = NULL;
	e->capopts = 0;
	if (s->nopts) {
		e->opts = mem_get(s->capopts * sizeof *e->opts);
		if (!e->opts) { mem_put(e, sizeof *e); return NULL; }
		memcpy(e->opts, s->opts, s->nopts * sizeof *e->opts);
		e->capopts = s->capopts;
	}
	e->neps = 0;   /* registrations belong to the number, not the socket */
	return e;
}

/* dup semantics: newfd refers to the same socket as oldfd. Clears newfd first. */
static void tab_dup(int oldfd, int newfd)
{
	if (!tracked_possible()) return;
	int p = tab_lock();
	ent_release_locked(tab_detach_locked(newfd));
	if (oldfd >= 0 && oldfd < g_tabsz && g_tab[oldfd]) {
		struct fdent *c = ent_clone_locked(g_tab[oldfd]);
		if (c) tab_put_locked(newfd, c);
	}
	tab_unlock(p);
}

/* caller holds g_tab_mu */
static void ent_record_locked(struct fdent *e, int level, int name, const void *val, socklen_t len)
{
	if (len > SOPT_MAX || (len && !val)) { e->unreplayable = 1; return; }
	struct sopt *o = NULL;
	for (int i = 0; i < e->nopts; i++)
		if (e->opts[i].level == level && e->opts[i].name == name) { o = &e->opts[i]; break; }
	if (!o) {
		if (e->nopts >= NOPTS_MAX) { e->unreplayable = 1; return; }
		if (e->nopts == e->capopts) {
			int cap = e->capopts ? e->capopts * 2 : 4;
			struct sopt *n = mem_get(cap * sizeof *n);
			if (!n) { e->unreplayable = 1; return; }
			if (e->nopts) memcpy(n, e->opts, e->nopts * sizeof *n);
			mem_put(e->opts, e->capopts * sizeof *n);
			e->opts = n;
			e->capopts = cap;
		}
		o = &e->opts[e->nopts++];
		o->level = level;
		o->name = name;
	}
	o->len = len;
	if (len) memcpy(o->val, val, len);
}

/* Applies an epoll_ctl that succeeded to e's registrations. */
static void ent_epoll(struct fdent *e, int epfd, int op, const struct epoll_event *ev)
{
	int i = 0;
	while (i < e->neps && e->eps[i].epfd != epfd) i++;
	if (op == EPOLL_CTL_DEL) {
		if (i < e->neps) e->eps[i] = e->eps[--e->neps];
		return;
	}
	if (i == e->neps) {
		if (op != EPOLL_CTL_ADD) return;
		if (e->neps == NEPOLL_MAX) { e->unreplayable = 1; return; }
		e->neps++;
		e->eps[i].epfd = epfd;
	}
	if (ev) e->eps[i].ev = *ev;
}

/* ---------- broker connection (caller holds g_broker_mu) ---------- */
static int fd_matches(int fd, dev_t dev, ino_t ino)
{
	struct stat st;
	return fd >= 0 && sys_fstat(fd, &st) == 0 && st.st_dev == dev && st.st_ino == ino;
}

/* move fd to >= g_hibase with CLOEXEC; returns the new fd (or the old one on failure) */
static int move_high(int fd)
{
	int n = sys_fcntl(fd, F_DUPFD_CLOEXEC, g_hibase);
	if (n < 0) return fd;
	sys_close(fd);
	return n;
}

static void broker_drop_locked(int backoff)
{
	if (g_bfd >= 0 && fd_matches(g_bfd, g_bdev, g_bino))
		sys_close(g_bfd);   /* only if it is still ours */
	g_bfd = -1;
	g_nreq = 0;
	if (backoff) g_retry_at = now_ms() + RETRY_MS;
}

/* A connection to the broker, or -1. Non-blocking: a broker that does not
 * accept (stopped, hung, out of fds) fills its backlog, after which a
 * blocking connect would wait for ever, holding the broker lock. */
static int broker_sock(void)
{
	int s = (int)syscall(SYS_socket, AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (s < 0) return -1;
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	size_t nl = strlen(g_name);
	memcpy(sa.sun_path + 1, g_name, nl);
	if (syscall(SYS_connect, s, &sa, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + nl)) < 0) {
		sys_close(s);
		return -1;
	}
	/* Only the broker's listener: skiffd binds the address as root before
	 * the container runs and holds it. Should a process of the container
	 * have bound the name anyway (an agent down while the broker died), it
	 * would get the app's sockets and could keep copies. SO_PEERCRED of a
	 * connected Unix socket is the credentials of the listener's listen(),
	 * which only root's (uid 0 in this user namespace) may be. */
	struct ucred uc;
	socklen_t ul = sizeof uc;
	if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &uc, &ul) < 0 || uc.uid != 0) {
		sys_close(s);
		return -1;
	}
	return s;
}

static void broker_adopt(int s)
{
	struct stat st;
	s = move_high(s);
	if (sys_fstat(s, &st) < 0) { sys_close(s); return; }
	g_bfd = s;
	g_bdev = st.st_dev;
	g_bino = st.st_ino;
	g_primed = 0;
}

/* The connection is still ours: the app may have closed or overwritten it
 * (close_range, dup2).  Checked before every use, since reading another
 * file's data would be worse than a stat. */
static int broker_valid_locked(void)
{
	if (g_bfd >= 0 && fd_matches(g_bfd, g_bdev, g_bino)) return 1;
	broker_drop_locked(0);   /* forgets it; the number is the app's now */
	return 0;
}

/* Waits until fd is readable or the deadline (now_ms()) has passed:
 * poll's result. A signal (the app's timers) neither ends the wait early nor
 * starts it again. */
static int wait_readable(int fd, uint64_t deadline)
{
	struct pollfd p = { .fd = fd, .events = POLLIN };
	for (;;) {
		uint64_t now = now_ms();
		int r = poll(&p, 1, now < deadline ? (int)(deadline - now) : 0);
		if (r >= 0 || errno != EINTR) return r;
	}
}

/* Receives one message of exactly len bytes, waiting up to WAIT_MS. */
static int recv_exact(int s, void *buf, size_t len)
{
	return wait_readable(s, now_ms() + WAIT_MS) == 1 && recv(s, buf, len, MSG_DONTWAIT) == (ssize_t)len ? 0 : -1;
}

/* A new broker connection that sent a valid hello, or -1. */
static int broker_connect(struct skiff_hello *h)
{
	int s = broker_sock();
	if (s < 0) return -1;
	if (recv_exact(s, h, sizeof *h) < 0 || h->magic != SKIFF_HELLO_MAGIC || h->version != SKIFF_PROTO_VERSION ||
	    h->prefix > 32) {
		sys_close(s);
		return -1;
	}
	return s;
}

/* connected, or -1 */
static int broker_ensure_locked(void)
{
	if (g_bfd >= 0) return 0;
	if (g_retry_at && now_ms() < g_retry_at) return -1;
	struct skiff_hello h;
	int s = broker_connect(&h);
	if (s < 0) { g_retry_at = now_ms() + RETRY_MS; return -1; }
	g_mask = h.prefix ? htonl(~0u << (32 - h.prefix)) : 0;
	g_net = h.net & g_mask;
	g_ip = h.ip;
	g_host_netns = h.host_netns;
	g_have_hello = 1;
	g_nreq = 0;
	broker_adopt(s);
	return g_bfd >= 0 ? 0 : -1;
}

/* non-blocking; counters piggyback.  Returns 0 if sent. */
static int broker_send_locked(uint8_t op, uint8_t arg)
{
	struct skiff_msg m = { .op = op, .arg = arg };
	m.replaced = __atomic_exchange_n(&g_cnt_replaced, 0, __ATOMIC_RELAXED);
	m.fallback = __atomic_exchange_n(&g_cnt_fallback, 0, __ATOMIC_RELAXED);
	ssize_t r = send(g_bfd, &m, sizeof m, MSG_DONTWAIT | MSG_NOSIGNAL);
	if (r == (ssize_t)sizeof m) return 0;
	int e = errno;
	__atomic_add_fetch(&g_cnt_replaced, m.replaced, __ATOMIC_RELAXED);
	__atomic_add_fetch(&g_cnt_fallback, m.fallback, __ATOMIC_RELAXED);
	if (r >= 0 || (e != EAGAIN && e != EINTR)) broker_drop_locked(1);
	return -1;
}

/* IP_TRANSPARENT on a replaced listener, which only the broker may set: the
 * overlay-path connections it accepts reply from the container's address.
 * Over a connection of its own, since on the shared one the reply would
 * queue behind the sockets.  Returns 0 once set. */
static int broker_transparent(int fd)
{
	struct skiff_hello h;
	int s = broker_connect(&h);
	if (s < 0) return -1;
	struct skiff_msg m = { .op = SKIFF_OP_TRANSPARENT };
	struct iovec iov = { &m, sizeof m };
	union skiff_fds_cmsg u;
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
	skiff_attach_fds(&mh, &u, &fd, 1);
	struct skiff_reply rep = { 0 };
	int ok = sendmsg(s, &mh, MSG_NOSIGNAL) == (ssize_t)sizeof m && recv_exact(s, &rep, sizeof rep) == 0 && rep.n == 1;
	sys_close(s);
	return ok ? 0 : -1;
}

/* ---------- the pool (caller holds g_broker_mu) ---------- */
static int credit_locked(void) { return g_npool + g_nreq * g_batch; }

/* Ask for the next batch (non-blocking) when few sockets are still due. */
static void broker_request_locked(void)
{
	if (credit_locked() > g_low_water || !broker_valid_locked()) return;
	if (broker_send_locked(SKIFF_OP_SOCKETS, (uint8_t)g_batch) == 0)
		g_nreq++;
}

static uint64_t cookie_of(int fd)
{
	uint64_t c = 0;
	socklen_t l = sizeof c;
	return getsockopt(fd, SOL_SOCKET, SO_COOKIE, &c, &l) == 0 ? c : 0;
}

/* Close the pooled sockets that are still ours (the app may have closed or
 * overwritten their numbers). */
static void pool_drop_locked(void)
{
	for (int i = 0; i < g_npool; i++)
		if (cookie_of(g_pool[i].fd) == g_pool[i].cookie)
			sys_close(g_pool[i].fd);
	g_npool = 0;
}

/* A pooled socket at the lowest free fd, or -1 (pool empty, or the app out
 * of fds: errno EMFILE). Each is checked to be the socket the shim pooled
 * before the shim touches it: a number the app closed or overwrote behind
 * the shim's back (bash's "exec 800>file") holds the app's file now, and
 * closing even a duplicate of that would release the app's POSIX locks. */
static int pool_take_locked(int cloexec)
{
	while (g_npool > 0) {
		struct pooled p = g_pool[--g_npool];
		if (cookie_of(p.fd) != p.cookie)
			continue;   /* the app's now: leave it alone */
		int fd = sys_fcntl(p.fd, cloexec ? F_DUPFD_CLOEXEC : F_DUPFD, 0);
		if (fd < 0) { g_npool++; return -1; }
		sys_close(p.fd);
		return fd;
	}
	return -1;
}

/* Puts received sockets in the pool, at >= g_hibase with FD_CLOEXEC: a dup
 * each, then one close_range for the numbers they arrived at. */
static void pool_put_locked(const int *fds, int n)
{
	int moved[BATCH], nmoved = 0;
	for (int i = 0; i < n; i++) {
		int fd = fds[i];
		if (g_npool == BATCH) { sys_close(fd); continue; }
		int h = sys_fcntl(fd, F_DUPFD_CLOEXEC, g_hibase);
		if (h >= 0) { moved[nmoved++] = fd; fd = h; }
		uint64_t c = cookie_of(fd);
		if (!c) { sys_close(fd); continue; }
		g_pool[g_npool++] = (struct pooled){ .fd = fd, .cookie = c };
	}
	skiff_close_fds(moved, nmoved);
}

enum { TAKE_GONE = -1, TAKE_NONE = -2, TAKE_BROKEN = -3 };

/* Receives the next batch the broker owes, waiting up to WAIT_MS. The first
 * socket lands at the lowest free fd, where socket()'s would, and is
 * returned; the others go to the pool. Returns the fd, TAKE_GONE (the app
 * closed or overwrote the connection), TAKE_NONE (the broker could not create
 * any) or TAKE_BROKEN. */
static int recv_batch_locked(int cloexec)
{
	uint64_t deadline = now_ms() + WAIT_MS;
	for (;;) {
		/* checked before each read: reading another file's data would be
		 * worse than a stat (once per batch, and after each wait) */
		if (!broker_valid_locked()) return TAKE_GONE;
		struct skiff_reply rep;
		struct iovec iov = { &rep, sizeof rep };
		union skiff_fds_cmsg u;
		struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1 };
		skiff_expect_fds(&m, &u, g_batch);
		ssize_t r = recvmsg(g_bfd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		if (r < 0 && errno == EINTR) continue;
		if (r < 0 && errno == EAGAIN) {
			/* A burst (an event loop reconnecting many connections at
			 * once) took the pool faster than the broker refilled it:
			 * ask earlier from now on. */
			if (g_primed) g_low_water = g_low_water * 2 > LOW_WATER_MAX ? LOW_WATER_MAX : g_low_water * 2;
			if (wait_readable(g_bfd, deadline) <= 0) return TAKE_BROKEN;   /* hung broker */
			continue;
		}
		int fds[BATCH], n = r >= 0 ? skiff_received_fds(&m, fds, g_batch) : -1;
		if (r != (ssize_t)sizeof rep || (m.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || n < 0 || rep.n != (uint32_t)n) {
			/* EOF, error, garbage (more fds than asked for: CTRUNC, or
			 * n > g_batch, whose fds skiff_received_fds closed) */
			for (int i = 0; i < n; i++) sys_close(fds[i]);
			return TAKE_BROKEN;
		}
		g_nreq--;
		g_primed = 1;
		if (!n) return TAKE_NONE;
		pool_put_locked(fds + 1, n - 1);
		if (!cloexec && sys_fcntl(fds[0], F_SETFD, 0) < 0) { sys_close(fds[0]); return TAKE_BROKEN; }
		return fds[0];
	}
}

/* A fresh host socket at the lowest free fd, or -1 (broker unavailable). */
static int take_host_socket(int type)
{
	int cloexec = type & SOCK_CLOEXEC, fd = -1, pb = broker_lock();
	for (int attempt = 0; attempt < 2 && fd < 0; attempt++) {
		fd = pool_take_locked(cloexec);
		if (fd >= 0) break;
		if (g_npool) {
			/* The app is out of fds, some of them the pool's: it gets
			 * them back, and socket() falls back to a container socket
			 * as it would have succeeded without the shim. */
			pool_drop_locked();
			break;
		}
		if ((g_retry_at && now_ms() < g_retry_at) || broker_ensure_locked() < 0) break;
		g_retry_at = 0;
		broker_request_locked();
		if (!g_nreq) {                          /* none due and none could be asked for */
			int clobbered = g_bfd < 0 && !g_retry_at;   /* the app closed it: reconnect at once */
			if (g_bfd >= 0) broker_drop_locked(1);
			if (clobbered) continue;
			break;
		}
		fd = recv_batch_locked(cloexec);
		if (fd == TAKE_GONE)
			continue;                           /* the app's now: a new connection, at once */
		if (fd == TAKE_NONE)
			g_retry_at = now_ms() + RETRY_MS;   /* the broker cannot create sockets right now */
		else if (fd == TAKE_BROKEN)
			broker_drop_locked(1);
		if (fd < 0) break;
	}
	if (fd >= 0 && g_bfd >= 0)
		broker_request_locked();                /* ahead of demand, non-blocking */
	broker_unlock(pb);
	if (fd < 0) return -1;
	if ((type & SOCK_NONBLOCK) && sys_fcntl(fd, F_SETFL, O_NONBLOCK) < 0) { sys_close(fd); return -1; }
	int p = tab_lock();
	struct fdent *e = ent_new_locked();
	if (e) {
		e->state = ST_FRESH;
		tab_put_locked(fd, e);
	}
	tab_unlock(p);
	if (!e) { sys_close(fd); return -1; }
	return fd;
}

/* ---------- counters / events ---------- */
static void count_replaced(void) { __atomic_add_fetch(&g_cnt_replaced, 1, __ATOMIC_RELAXED); }

static void count_fallback(int reason)
{
	__atomic_add_fetch(&g_cnt_fallback, 1, __ATOMIC_RELAXED);
	if (reason == SKIFF_R_UNAVAILABLE) return;   /* reported with the next request */
	/* best effort: never wait for a thread that is waiting for the broker */
	int p = t_inshim;
	t_inshim = 1;
	if (pthread_mutex_trylock(&g_broker_mu) == 0) {
		if (g_bfd >= 0 && fd_matches(g_bfd, g_bdev, g_bino))
			broker_send_locked(SKIFF_OP_FLUSH, (uint8_t)reason);
		pthread_mutex_unlock(&g_broker_mu);
	}
	t_inshim = p;
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
	int s = r_socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (s < 0 && errno == EMFILE) {
		/* the swap needs one more fd: the pool's are the app's first */
		int p = broker_lock();
		pool_drop_locked();
		broker_unlock(p);
		s = r_socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	}
	if (s < 0) { int er = errno; ent_free(e); errno = er; return -1; }
	for (int i = 0; i < e->nopts; i++)
		r_setsockopt(s, e->opts[i].level, e->opts[i].name, e->opts[i].val, e->opts[i].len);
	int fl = sys_fcntl(fd, F_GETFL, 0), fdfl = sys_fcntl(fd, F_GETFD, 0);
	int er = 0;
	if (fl < 0 || fdfl < 0) er = errno;
	else if (e->has_bind && r_bind(s, (const struct sockaddr *)&e->bindaddr, sizeof e->bindaddr) < 0) er = errno;
	else if ((fl & O_NONBLOCK) && sys_fcntl(s, F_SETFL, O_NONBLOCK) < 0) er = errno;
	else if (sys_dup3(s, fd, (fdfl & FD_CLOEXEC) ? O_CLOEXEC : 0) < 0) er = errno;
	sys_close(s);
	/* the dup3 closed the host socket, and with it its registrations */
	for (int i = 0; !er && r_epoll_ctl && i < e->neps; i++)
		r_epoll_ctl(e->eps[i].epfd, EPOLL_CTL_ADD, fd, &e->eps[i].ev);
	ent_free(e);
	if (er) { errno = er; return -1; }
	count_fallback(reason);
	return 0;
}

static int fast_dest(const struct sockaddr *sa, socklen_t len)
{
	if (len < sizeof(struct sockaddr_in) || sa->sa_family != AF_INET || !g_have_hello) return 0;
	return skiff_fast_ip(((const struct sockaddr_in *)sa)->sin_addr.s_addr, g_net, g_mask);
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
	RESOLVE(r_socket);
	int base = type & ~(SOCK_NONBLOCK | SOCK_CLOEXEC);
	if (!g_enabled || t_inshim || domain != AF_INET || base != SOCK_STREAM ||
	    (protocol != 0 && protocol != IPPROTO_TCP))
		return r_socket(domain, type, protocol);
	int saved = errno;
	t_inshim = 1;
	int fd = take_host_socket(type);
	t_inshim = 0;
	if (fd >= 0) { errno = saved; return fd; }
	count_fallback(SKIFF_R_UNAVAILABLE);
	errno = saved;
	return r_socket(domain, type, protocol);
}

EXPORT int connect(int fd, const struct sockaddr *sa, socklen_t len)
{
	RESOLVE(r_connect);
	if (t_inshim || !sa) return t_connect(fd, sa, len);
	struct fdent *e = tab_take(fd);
	if (!e) return t_connect(fd, sa, len);
	int r, er;
	if (fast_dest(sa, len)) {
		r = t_connect(fd, sa, len);
		er = errno;
		if (r == 0 || !is_fallback_errno(er)) {
			if (r == 0 || er == EINPROGRESS) count_replaced();
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
	RESOLVE(r_bind);
	if (t_inshim || !sa) return r_bind(fd, sa, len);
	struct fdent *e = tab_take(fd);
	if (!e) return r_bind(fd, sa, len);
	if (e->state != ST_FRESH) { tab_put(fd, e); return r_bind(fd, sa, len); }
	if (len >= sizeof(struct sockaddr_in) && sa->sa_family == AF_INET) {
		uint32_t ip = ((const struct sockaddr_in *)sa)->sin_addr.s_addr;
		if (ip == INADDR_ANY || (g_have_hello && ip == g_ip)) {
			int r = r_bind(fd, sa, len), er = errno;
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
			return r_bind(fd, sa, len);
		}
	}
	if (swap_to_container(fd, e, SKIFF_R_BIND) == -1) return -1;
	return r_bind(fd, sa, len);
}

EXPORT int listen(int fd, int backlog)
{
	RESOLVE(r_listen);
	if (t_inshim) return t_listen(fd, backlog);
	struct fdent *e = tab_take(fd);
	if (!e) return t_listen(fd, backlog);
	if (e->state == ST_FRESH) {
		/* never autobind a host socket to 0.0.0.0: explicit bind lets the hook move it to 127.0.0.1 */
		struct sockaddr_in any = { .sin_family = AF_INET };
		if (r_bind(fd, (struct sockaddr *)&any, sizeof any) < 0) {
			if (swap_to_container(fd, e, SKIFF_R_LISTEN) == -1) return -1;
			return t_listen(fd, backlog);
		}
		e->state = ST_BOUND;
		e->has_bind = 1;
		e->bindaddr = any;
	}
	if (!e->transparent && broker_transparent(fd) < 0) {
		/* unreachable over the overlay: a container listener is the overlay's */
		if (swap_to_container(fd, e, SKIFF_R_LISTEN) == -1) return -1;
		return t_listen(fd, backlog);
	}
	e->transparent = 1;   /* a listen() that fails may be tried again */
	int r = t_listen(fd, backlog), er = errno;
	if (r < 0) { tab_put(fd, e); errno = er; return r; }
	if (!skiff_on_lo(fd)) { count_replaced(); ent_free(e); errno = er; return 0; }
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
	RESOLVE(r_setsockopt);
	if (t_inshim || !tracked_possible()) return r_setsockopt(fd, level, name, val, len);
	int r = r_setsockopt(fd, level, name, val, len), er = errno;
	if (r == 0) {
		/* recorded (BOUND too): replayed if a connect swaps */
		int p = tab_lock();
		if (fd >= 0 && fd < g_tabsz && g_tab[fd]) ent_record_locked(g_tab[fd], level, name, val, len);
		tab_unlock(p);
		errno = er;
		return 0;
	}
	struct fdent *e = er == EPERM ? tab_take(fd) : NULL;
	if (e && e->state == ST_FRESH) {
		if (swap_to_container(fd, e, SKIFF_R_SOCKOPT) < 0) { errno = er; return -1; }
		return r_setsockopt(fd, level, name, val, len);
	}
	if (e) tab_put(fd, e);
	errno = er;
	return r;
}

EXPORT int close(int fd)
{
	RESOLVE(r_close);
	if (!t_inshim && tracked_possible()) {
		int saved = errno;
		tab_clear(fd);   /* before closing: the number cannot be reused meanwhile */
		errno = saved;
	}
	return r_close(fd);
}

EXPORT int epoll_ctl(int epfd, int op, int fd, struct epoll_event *ev)
{
	RESOLVE(r_epoll_ctl);
	if (!r_epoll_ctl) { errno = ENOSYS; return -1; }
	int r = r_epoll_ctl(epfd, op, fd, ev);
	if (r == 0 && !t_inshim && tracked_possible()) {
		int saved = errno, p = tab_lock();
		if (fd >= 0 && fd < g_tabsz && g_tab[fd]) ent_epoll(g_tab[fd], epfd, op, ev);
		tab_unlock(p);
		errno = saved;
	}
	return r;
}

EXPORT int dup(int fd)
{
	RESOLVE(r_dup);
	int r = r_dup(fd);
	if (r >= 0 && !t_inshim && tracked_possible()) { int s = errno; tab_dup(fd, r); errno = s; }
	return r;
}

EXPORT int dup2(int oldfd, int newfd)
{
	RESOLVE(r_dup2);
	int r = r_dup2(oldfd, newfd);
	if (r >= 0 && oldfd != newfd && !t_inshim && tracked_possible()) { int s = errno; tab_dup(oldfd, newfd); errno = s; }
	return r;
}

EXPORT int dup3(int oldfd, int newfd, int flags)
{
	RESOLVE(r_dup3);
	int r = r_dup3(oldfd, newfd, flags);
	if (r >= 0 && !t_inshim && tracked_possible()) { int s = errno; tab_dup(oldfd, newfd); errno = s; }
	return r;
}

static int fcntl_common(int (*real)(int, int, ...), int fd, int cmd, void *arg)
{
	int r = real(fd, cmd, arg);
	if (r >= 0 && (cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC) && !t_inshim && tracked_possible()) {
		int s = errno;
		tab_dup(fd, r);
		errno = s;
	}
	return r;
}

EXPORT int fcntl(int fd, int cmd, ...)
{
	RESOLVE(r_fcntl);
	va_list ap;
	va_start(ap, cmd);
	void *arg = va_arg(ap, void *);   /* int or pointer: same slot on all Linux ABIs glibc supports */
	va_end(ap);
	return fcntl_common(r_fcntl, fd, cmd, arg);
}

EXPORT int fcntl64(int fd, int cmd, ...)
{
	RESOLVE(r_fcntl64);
	va_list ap;
	va_start(ap, cmd);
	void *arg = va_arg(ap, void *);
	va_end(ap);
	return fcntl_common(r_fcntl64, fd, cmd, arg);
}

/* ---------- fork / init / exit ---------- */
/* The forking thread's t_inshim, kept while it holds both locks: a signal
 * handler that calls close() or socket() meanwhile must pass through (the
 * locks are its own thread's). */
static int g_fork_inshim;

static void atfork_prepare(void)
{
	int p = t_inshim;
	t_inshim = 1;
	pthread_mutex_lock(&g_broker_mu);
	pthread_mutex_lock(&g_tab_mu);
	g_fork_inshim = p;
}

static void atfork_parent(void)
{
	int p = g_fork_inshim;
	pthread_mutex_unlock(&g_tab_mu);
	pthread_mutex_unlock(&g_broker_mu);
	t_inshim = p;
}

static void atfork_child(void)
{
	/* The child must not share the parent's broker connection: the sockets
	 * queued on it are the parent's. */
	if (g_bfd >= 0 && fd_matches(g_bfd, g_bdev, g_bino))
		sys_close(g_bfd);
	g_bfd = -1;
	g_nreq = 0;
	pool_drop_locked();        /* copies of sockets the parent hands out */
	g_low_water = LOW_WATER;   /* a child learns its own bursts */
	g_retry_at = 0;
	g_cnt_replaced = g_cnt_fallback = 0;   /* the parent reports its own */
	int p = g_fork_inshim;
	pthread_mutex_unlock(&g_tab_mu);
	pthread_mutex_unlock(&g_broker_mu);
	t_inshim = p;
}

__attribute__((constructor)) static void skiff_init(void)
{
	resolve();
	const char *v = getenv("SKIFF_SOCKETS");
	if (v && (!strcmp(v, "off") || !strcmp(v, "0") || !strcmp(v, "false") || !strcmp(v, "no")))
		return;
	v = getenv("SKIFF_BROKER");
	if (v && *v && strlen(v) < sizeof g_name - 1) {
		memset(g_name, 0, sizeof g_name);
		memcpy(g_name, v, strlen(v));
	}
	struct rlimit rl;
	rlim_t lim = 1024;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < lim)
		lim = rl.rlim_cur;
	g_hibase = (int)(lim * 3 / 4);
	/* a batch lands in the app's fd table before it moves up: under a small
	 * limit it must leave the app room, and fit above g_hibase beside the
	 * broker connection */
	g_batch = (int)(lim / 4) - 1;
	if (g_batch > BATCH) g_batch = BATCH;
	if (g_batch < 1) g_batch = 1;
	if (!r_socket || !r_connect || !r_bind || !r_listen || !r_setsockopt || !r_close ||
	    !r_dup || !r_dup2 || !r_dup3 || !r_fcntl)
		return;   /* cannot interpose safely: stay disabled */
	if (pthread_atfork(atfork_prepare, atfork_parent, atfork_child) != 0)
		return;
	g_enabled = 1;
}

__attribute__((destructor)) static void skiff_fini(void)
{
	if (!g_enabled || t_inshim) return;
	if (!__atomic_load_n(&g_cnt_replaced, __ATOMIC_RELAXED) &&
	    !__atomic_load_n(&g_cnt_fallback, __ATOMIC_RELAXED))
		return;
	int saved = errno;
	if (pthread_mutex_trylock(&g_broker_mu) != 0) return;
	if (g_bfd >= 0 && !fd_matches(g_bfd, g_bdev, g_bino)) g_bfd = -1;
	if (g_bfd < 0) {
		/* e.g. a forked child that only used inherited sockets: a quick
		 * non-blocking connect just for the flush (hello is left unread) */
		int s = broker_sock();
		if (s >= 0) broker_adopt(s);
	}
	if (g_bfd >= 0) broker_send_locked(SKIFF_OP_FLUSH, SKIFF_R_FLUSH);
	pthread_mutex_unlock(&g_broker_mu);
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

#define RETRY_READ(real, fd, flags, ...) do { \
	RESOLVE(real); \
	if (!real) { errno = ENOSYS; return -1; } \
	ssize_t got_; \
	while ((got_ = real(fd, __VA_ARGS__)) < 0 && spurious_eagain(fd, flags)) \
		; \
	return got_; \
} while (0)

EXPORT ssize_t read(int fd, void *buf, size_t len) { RETRY_READ(r_read, fd, 0, buf, len); }
EXPORT ssize_t readv(int fd, const struct iovec *iov, int n) { RETRY_READ(r_readv, fd, 0, iov, n); }
EXPORT ssize_t recv(int fd, void *buf, size_t len, int flags) { RETRY_READ(r_recv, fd, flags, buf, len, flags); }
EXPORT ssize_t recvfrom(int fd, void *buf, size_t len, int flags, struct sockaddr *sa, socklen_t *sl)
{
	RETRY_READ(r_recvfrom, fd, flags, buf, len, flags, sa, sl);
}
EXPORT ssize_t recvmsg(int fd, struct msghdr *m, int flags) { RETRY_READ(r_recvmsg, fd, flags, m, flags); }
/* what programs built with _FORTIFY_SOURCE call */
EXPORT ssize_t __read_chk(int fd, void *buf, size_t len, size_t buflen) { RETRY_READ(r_read_chk, fd, 0, buf, len, buflen); }
EXPORT ssize_t __recv_chk(int fd, void *buf, size_t len, size_t buflen, int flags)
{
	RETRY_READ(r_recv_chk, fd, flags, buf, len, buflen, flags);
}
EXPORT ssize_t __recvfrom_chk(int fd, void *buf, size_t len, size_t buflen, int flags, struct sockaddr *sa, socklen_t *sl)
{
	RETRY_READ(r_recvfrom_chk, fd, flags, buf, len, buflen, flags, sa, sl);
}
