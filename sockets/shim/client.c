/* client.c - libskiff.so's side of the broker protocol (skiff_broker.h): the
 * connection to the container's broker, the pool of host sockets it sends
 * ahead of demand, and the counters reported to it.
 *
 * The connection and the pool live at high fd numbers (>= hibase: 3/4 of
 * min(fd limit, 1024)), where the app rarely looks; each is checked to be
 * still the shim's before the shim touches it (the app may close or
 * overwrite any number behind the shim's back).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stddef.h>
#include <string.h>
#include <sys/un.h>
#include <time.h>

#include "shim.h"
#include "skiff_broker.h"

#define LOW_WATER   8       /* request the next batch when this few are still due ... */
#define LOW_WATER_MAX 56    /* ... or, after threads had to wait, up to this many */
#define WAIT_MS     500     /* max wait for a socket the broker owes */
#define RETRY_MS    1000    /* broker retry back-off */

/* A received host socket not yet handed out: its number and cookie, to tell
 * it from a file the app put there. */
struct pooled { int fd; uint64_t cookie; };

static struct {
	char name[sizeof(((struct sockaddr_un *)0)->sun_path)];
	int hibase;                /* the connection and the pool live at >= this */
	int batch;                 /* sockets per request: the pool fits above hibase */

	pthread_mutex_t mu;        /* everything below but the counters */
	int fd;                    /* the connection, or -1 */
	dev_t dev;
	ino_t ino;
	int nreq;                  /* batches asked for and not yet received */
	int low_water;             /* doubles each time a socket() had to wait */
	int primed;                /* a batch came over this connection (its first is no burst) */
	uint64_t retry_at;         /* ms, CLOCK_MONOTONIC: do not ask the broker before */
	struct pooled pool[BATCH];
	int npool;
	struct hello_info hello;

	uint32_t replaced, fallback;   /* counters not yet reported (atomic) */
} cl = {
	.name = SKIFF_BROKER_NAME,
	.hibase = 768,
	.batch = BATCH,
	.mu = PTHREAD_MUTEX_INITIALIZER,
	.fd = -1,
	.low_water = LOW_WATER,
};

const struct hello_info *client_hello(void) { return &cl.hello; }

static int client_lock(void) { int p = shim_enter(); pthread_mutex_lock(&cl.mu); return p; }
static void client_unlock(int p) { pthread_mutex_unlock(&cl.mu); shim_leave(p); }

void client_init(const char *name, unsigned long lim)
{
	if (name && *name && strlen(name) < sizeof cl.name - 1) {
		memset(cl.name, 0, sizeof cl.name);
		memcpy(cl.name, name, strlen(name));
	}
	if (lim > 1024) lim = 1024;
	cl.hibase = (int)(lim * 3 / 4);
	/* a batch lands in the app's fd table before it moves up: under a small
	 * limit it must leave the app room, and fit above hibase beside the
	 * broker connection */
	cl.batch = (int)(lim / 4) - 1;
	if (cl.batch > BATCH) cl.batch = BATCH;
	if (cl.batch < 1) cl.batch = 1;
}

static uint64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* ---------- the connection (caller holds cl.mu) ---------- */
static int fd_matches(int fd, dev_t dev, ino_t ino)
{
	struct stat st;
	return fd >= 0 && sys_fstat(fd, &st) == 0 && st.st_dev == dev && st.st_ino == ino;
}

static int conn_ours(void) { return cl.fd >= 0 && fd_matches(cl.fd, cl.dev, cl.ino); }

/* move fd to >= hibase with CLOEXEC; returns the new fd (or the old one on failure) */
static int move_high(int fd)
{
	int n = sys_fcntl(fd, F_DUPFD_CLOEXEC, cl.hibase);
	if (n < 0) return fd;
	sys_close(fd);
	return n;
}

static void broker_drop_locked(int backoff)
{
	if (conn_ours())
		sys_close(cl.fd);   /* only if it is still ours */
	cl.fd = -1;
	cl.nreq = 0;
	if (backoff) cl.retry_at = now_ms() + RETRY_MS;
}

/* A connection to the broker, or -1. Non-blocking: a broker that does not
 * accept (stopped, hung, out of fds) fills its backlog, after which a
 * blocking connect would wait for ever, holding the broker lock. */
static int broker_sock(void)
{
	int s = (int)syscall(SYS_socket, AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (s < 0) return -1;
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	size_t nl = strlen(cl.name);
	memcpy(sa.sun_path + 1, cl.name, nl);
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
	cl.fd = s;
	cl.dev = st.st_dev;
	cl.ino = st.st_ino;
	cl.primed = 0;
}

/* The connection is still ours: the app may have closed or overwritten it
 * (close_range, dup2).  Checked before every use, since reading another
 * file's data would be worse than a stat. */
static int broker_valid_locked(void)
{
	if (conn_ours()) return 1;
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
	if (cl.fd >= 0) return 0;
	if (cl.retry_at && now_ms() < cl.retry_at) return -1;
	struct skiff_hello h;
	int s = broker_connect(&h);
	if (s < 0) { cl.retry_at = now_ms() + RETRY_MS; return -1; }
	cl.hello.mask = h.prefix ? htonl(~0u << (32 - h.prefix)) : 0;
	cl.hello.net = h.net & cl.hello.mask;
	cl.hello.ip = h.ip;
	cl.hello.host_netns = h.host_netns;
	cl.hello.have = 1;
	cl.nreq = 0;
	broker_adopt(s);
	return cl.fd >= 0 ? 0 : -1;
}

/* non-blocking; counters piggyback.  Returns 0 if sent. */
static int broker_send_locked(uint8_t op, uint8_t arg)
{
	struct skiff_msg m = { .op = op, .arg = arg };
	m.replaced = __atomic_exchange_n(&cl.replaced, 0, __ATOMIC_RELAXED);
	m.fallback = __atomic_exchange_n(&cl.fallback, 0, __ATOMIC_RELAXED);
	ssize_t r = send(cl.fd, &m, sizeof m, MSG_DONTWAIT | MSG_NOSIGNAL);
	if (r == (ssize_t)sizeof m) return 0;
	int e = errno;
	__atomic_add_fetch(&cl.replaced, m.replaced, __ATOMIC_RELAXED);
	__atomic_add_fetch(&cl.fallback, m.fallback, __ATOMIC_RELAXED);
	if (r >= 0 || (e != EAGAIN && e != EINTR)) broker_drop_locked(1);
	return -1;
}

/* IP_TRANSPARENT on a replaced listener, which only the broker may set: the
 * overlay-path connections it accepts reply from the container's address.
 * Over a connection of its own, since on the shared one the reply would
 * queue behind the sockets.  Returns 0 once set. */
int client_transparent(int fd)
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

/* ---------- the pool (caller holds cl.mu) ---------- */
static int credit_locked(void) { return cl.npool + cl.nreq * cl.batch; }

/* Ask for the next batch (non-blocking) when few sockets are still due. */
static void broker_request_locked(void)
{
	if (credit_locked() > cl.low_water || !broker_valid_locked()) return;
	if (broker_send_locked(SKIFF_OP_SOCKETS, (uint8_t)cl.batch) == 0)
		cl.nreq++;
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
	for (int i = 0; i < cl.npool; i++)
		if (cookie_of(cl.pool[i].fd) == cl.pool[i].cookie)
			sys_close(cl.pool[i].fd);
	cl.npool = 0;
}

void client_drop_pool(void)
{
	int p = client_lock();
	pool_drop_locked();
	client_unlock(p);
}

/* A pooled socket at the lowest free fd, or -1 (pool empty, or the app out
 * of fds: errno EMFILE). Each is checked to be the socket the shim pooled
 * before the shim touches it: a number the app closed or overwrote behind
 * the shim's back (bash's "exec 800>file") holds the app's file now, and
 * closing even a duplicate of that would release the app's POSIX locks. */
static int pool_take_locked(int cloexec)
{
	while (cl.npool > 0) {
		struct pooled p = cl.pool[--cl.npool];
		if (cookie_of(p.fd) != p.cookie)
			continue;   /* the app's now: leave it alone */
		int fd = sys_fcntl(p.fd, cloexec ? F_DUPFD_CLOEXEC : F_DUPFD, 0);
		if (fd < 0) { cl.npool++; return -1; }
		sys_close(p.fd);
		return fd;
	}
	return -1;
}

/* Puts received sockets in the pool, at >= hibase with FD_CLOEXEC: a dup
 * each, then one close_range for the numbers they arrived at. */
static void pool_put_locked(const int *fds, int n)
{
	int moved[BATCH], nmoved = 0;
	for (int i = 0; i < n; i++) {
		int fd = fds[i];
		if (cl.npool == BATCH) { sys_close(fd); continue; }
		int h = sys_fcntl(fd, F_DUPFD_CLOEXEC, cl.hibase);
		if (h >= 0) { moved[nmoved++] = fd; fd = h; }
		uint64_t c = cookie_of(fd);
		if (!c) { sys_close(fd); continue; }
		cl.pool[cl.npool++] = (struct pooled){ .fd = fd, .cookie = c };
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
		skiff_expect_fds(&m, &u, cl.batch);
		ssize_t r = recvmsg(cl.fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		if (r < 0 && errno == EINTR) continue;
		if (r < 0 && errno == EAGAIN) {
			/* A burst (an event loop reconnecting many connections at
			 * once) took the pool faster than the broker refilled it:
			 * ask earlier from now on. */
			if (cl.primed) cl.low_water = cl.low_water * 2 > LOW_WATER_MAX ? LOW_WATER_MAX : cl.low_water * 2;
			if (wait_readable(cl.fd, deadline) <= 0) return TAKE_BROKEN;   /* hung broker */
			continue;
		}
		int fds[BATCH], n = r >= 0 ? skiff_received_fds(&m, fds, cl.batch) : -1;
		if (r != (ssize_t)sizeof rep || (m.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || n < 0 || rep.n != (uint32_t)n) {
			/* EOF, error, garbage (more fds than asked for: CTRUNC, or
			 * n > batch, whose fds skiff_received_fds closed) */
			for (int i = 0; i < n; i++) sys_close(fds[i]);
			return TAKE_BROKEN;
		}
		cl.nreq--;
		cl.primed = 1;
		if (!n) return TAKE_NONE;
		pool_put_locked(fds + 1, n - 1);
		if (!cloexec && sys_fcntl(fds[0], F_SETFD, 0) < 0) { sys_close(fds[0]); return TAKE_BROKEN; }
		return fds[0];
	}
}

int client_take_socket(int type)
{
	int cloexec = type & SOCK_CLOEXEC, fd = -1, pb = client_lock();
	for (int attempt = 0; attempt < 2 && fd < 0; attempt++) {
		fd = pool_take_locked(cloexec);
		if (fd >= 0) break;
		if (cl.npool) {
			/* The app is out of fds, some of them the pool's: it gets
			 * them back, and socket() falls back to a container socket
			 * as it would have succeeded without the shim. */
			pool_drop_locked();
			break;
		}
		if ((cl.retry_at && now_ms() < cl.retry_at) || broker_ensure_locked() < 0) break;
		cl.retry_at = 0;
		broker_request_locked();
		if (!cl.nreq) {                         /* none due and none could be asked for */
			int clobbered = cl.fd < 0 && !cl.retry_at;   /* the app closed it: reconnect at once */
			if (cl.fd >= 0) broker_drop_locked(1);
			if (clobbered) continue;
			break;
		}
		fd = recv_batch_locked(cloexec);
		if (fd == TAKE_GONE)
			continue;                           /* the app's now: a new connection, at once */
		if (fd == TAKE_NONE)
			cl.retry_at = now_ms() + RETRY_MS;  /* the broker cannot create sockets right now */
		else if (fd == TAKE_BROKEN)
			broker_drop_locked(1);
		if (fd < 0) break;
	}
	if (fd >= 0 && cl.fd >= 0)
		broker_request_locked();                /* ahead of demand, non-blocking */
	client_unlock(pb);
	if (fd < 0) return -1;
	if ((type & SOCK_NONBLOCK) && sys_fcntl(fd, F_SETFL, O_NONBLOCK) < 0) { sys_close(fd); return -1; }
	return fd;
}

/* ---------- counters ---------- */
void client_count_replaced(void) { __atomic_add_fetch(&cl.replaced, 1, __ATOMIC_RELAXED); }

void client_count_fallback(int reason)
{
	__atomic_add_fetch(&cl.fallback, 1, __ATOMIC_RELAXED);
	if (reason == SKIFF_R_UNAVAILABLE) return;   /* reported with the next request */
	/* best effort: never wait for a thread that is waiting for the broker */
	int p = shim_enter();
	if (pthread_mutex_trylock(&cl.mu) == 0) {
		if (conn_ours())
			broker_send_locked(SKIFF_OP_FLUSH, (uint8_t)reason);
		pthread_mutex_unlock(&cl.mu);
	}
	shim_leave(p);
}

void client_flush(void)
{
	if (!__atomic_load_n(&cl.replaced, __ATOMIC_RELAXED) && !__atomic_load_n(&cl.fallback, __ATOMIC_RELAXED))
		return;
	if (pthread_mutex_trylock(&cl.mu) != 0) return;
	if (cl.fd >= 0 && !conn_ours()) cl.fd = -1;
	if (cl.fd < 0) {
		/* e.g. a forked child that only used inherited sockets: a quick
		 * non-blocking connect just for the flush (hello is left unread) */
		int s = broker_sock();
		if (s >= 0) broker_adopt(s);
	}
	if (cl.fd >= 0) broker_send_locked(SKIFF_OP_FLUSH, SKIFF_R_FLUSH);
	pthread_mutex_unlock(&cl.mu);
}

/* ---------- fork ---------- */
void client_fork_lock(void) { pthread_mutex_lock(&cl.mu); }
void client_fork_unlock(void) { pthread_mutex_unlock(&cl.mu); }

void client_fork_child(void)
{
	/* The child must not share the parent's broker connection: the sockets
	 * queued on it are the parent's. */
	if (conn_ours())
		sys_close(cl.fd);
	cl.fd = -1;
	cl.nreq = 0;
	pool_drop_locked();          /* copies of sockets the parent hands out */
	cl.low_water = LOW_WATER;    /* a child learns its own bursts */
	cl.retry_at = 0;
	cl.replaced = cl.fallback = 0;   /* the parent reports its own */
	pthread_mutex_unlock(&cl.mu);
}
