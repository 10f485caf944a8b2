/* sockcheck: socket-semantics checks for libskiff.so (run it with and without
 * LD_PRELOAD; it must behave the same).
 *
 *   sockcheck server IP PORT [--count N] [--expect-net CIDR]
 *       forking echo server; each connection first receives a 64-byte header
 *       "SKCK peer=IP:PORT local=IP:PORT" (what the server saw), then echo.
 *   sockcheck client IP PORT [--expect-net CIDR] [--server-peer IP] [--host yes|no] [--quick]
 *       all checks (or one echo with --quick); one line per check, exit 1 on failure.
 *   sockcheck loop IP PORT N          N sequential connect/echo/close; fd leak check
 *   sockcheck threads IP PORT T N     T threads x N connections each
 *
 * --server-peer: the peer address the server must report (proves which netns
 * the client socket lives in).  --host yes|no: the connected socket must (not)
 * be in a different netns than a plain UDP socket of this process.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef SO_NETNS_COOKIE
#define SO_NETNS_COOKIE 71
#endif
#define HDR 64

static int g_fail;
static struct sockaddr_in g_dst;
static uint32_t g_net, g_mask;
static int g_have_net;
static const char *g_server_peer;
static const char *g_host;

static void ok(const char *name) { printf("ok   %s\n", name); fflush(stdout); }
static void fail(const char *name, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(const char *name, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	printf("FAIL %s: ", name);
	vprintf(fmt, ap);
	printf("\n");
	fflush(stdout);
	va_end(ap);
	g_fail = 1;
}

static const char *fmt_sa(const struct sockaddr_in *a, char *buf, size_t n)
{
	char ip[INET_ADDRSTRLEN];
	inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
	snprintf(buf, n, "%s:%d", ip, ntohs(a->sin_port));
	return buf;
}

static int parse_cidr(const char *s)
{
	char b[64];
	const char *sl = strchr(s, '/');
	if (!sl || sl - s >= 64) return -1;
	memcpy(b, s, sl - s);
	b[sl - s] = 0;
	int len = atoi(sl + 1);
	struct in_addr a;
	if (inet_pton(AF_INET, b, &a) != 1 || len < 0 || len > 32) return -1;
	g_mask = len ? htonl(~0u << (32 - len)) : 0;
	g_net = a.s_addr & g_mask;
	g_have_net = 1;
	return 0;
}

/* getsockname/getpeername must be AF_INET and, with --expect-net, inside it */
static int check_names(const char *name, int s, char *out, size_t outn)
{
	struct sockaddr_in a, b;
	socklen_t la = sizeof a, lb = sizeof b;
	char x[64], y[64];
	if (getsockname(s, (struct sockaddr *)&a, &la) || getpeername(s, (struct sockaddr *)&b, &lb)) {
		fail(name, "getsockname/getpeername: %s", strerror(errno));
		return -1;
	}
	if (a.sin_family != AF_INET || b.sin_family != AF_INET) {
		fail(name, "family %d/%d", a.sin_family, b.sin_family);
		return -1;
	}
	fmt_sa(&a, x, sizeof x);
	fmt_sa(&b, y, sizeof y);
	if (out) snprintf(out, outn, "local=%s peer=%s", x, y);
	if (g_have_net && ((a.sin_addr.s_addr & g_mask) != g_net || (b.sin_addr.s_addr & g_mask) != g_net)) {
		fail(name, "address outside expected net: local=%s peer=%s", x, y);
		return -1;
	}
	return 0;
}

static int read_full(int s, void *buf, size_t n)
{
	size_t got = 0;
	while (got < n) {
		ssize_t r = read(s, (char *)buf + got, n - got);
		if (r < 0 && errno == EINTR) continue;
		if (r <= 0) return -1;
		got += r;
	}
	return 0;
}

static int write_full(int s, const void *buf, size_t n)
{
	size_t done = 0;
	while (done < n) {
		ssize_t r = write(s, (const char *)buf + done, n - done);
		if (r < 0 && errno == EINTR) continue;
		if (r <= 0) return -1;
		done += r;
	}
	return 0;
}

/* ---------------- server ---------------- */
static void serve_one(int c)
{
	char hdr[HDR], a[64], b[64];
	struct sockaddr_in pa, la;
	socklen_t pl = sizeof pa, ll = sizeof la;
	memset(hdr, ' ', sizeof hdr);
	getpeername(c, (struct sockaddr *)&pa, &pl);
	getsockname(c, (struct sockaddr *)&la, &ll);
	int n = snprintf(hdr, sizeof hdr, "SKCK peer=%s local=%s", fmt_sa(&pa, a, sizeof a), fmt_sa(&la, b, sizeof b));
	if (n < HDR) hdr[n] = ' ';
	hdr[HDR - 1] = '\n';
	if (write_full(c, hdr, HDR)) _exit(1);
	char buf[16384];
	for (;;) {
		ssize_t r = read(c, buf, sizeof buf);
		if (r < 0 && errno == EINTR) continue;
		if (r <= 0) break;
		if (write_full(c, buf, r)) break;
	}
	_exit(0);
}

static int do_server(int count)
{
	int one = 1;
	int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (ls < 0) { perror("socket"); return 2; }
	setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	if (bind(ls, (struct sockaddr *)&g_dst, sizeof g_dst) || listen(ls, 512)) { perror("bind/listen"); return 2; }
	struct sockaddr_in la;
	socklen_t ll = sizeof la;
	char b[64];
	getsockname(ls, (struct sockaddr *)&la, &ll);
	printf("listening %s pid %d\n", fmt_sa(&la, b, sizeof b), (int)getpid());
	fflush(stdout);
	signal(SIGCHLD, SIG_IGN);   /* auto-reap */
	int flagged = 0;
	for (int i = 0; count <= 0 || i < count; i++) {
		int c = accept4(ls, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (c < 0) { if (errno == EINTR) { i--; continue; } perror("accept4"); return 2; }
		int fl = fcntl(c, F_GETFL), fdf = fcntl(c, F_GETFD);
		if (!(fl & O_NONBLOCK) || !(fdf & FD_CLOEXEC)) {
			fail("accept4-flags", "F_GETFL=%#x F_GETFD=%#x", fl, fdf);
		} else if (!flagged) {
			ok("accept4-flags");
			flagged = 1;
		}
		if (g_have_net) check_names("server-names", c, NULL, 0);
		fcntl(c, F_SETFL, fl & ~O_NONBLOCK);
		pid_t p = fork();
		if (p == 0) { close(ls); serve_one(c); }
		close(c);
	}
	/* let the last children finish their echo */
	signal(SIGCHLD, SIG_DFL);
	while (wait(NULL) > 0 || errno == EINTR) {}
	return g_fail;
}

/* ---------------- client ---------------- */
static int conn_blocking(void)
{
	int s = socket(AF_INET, SOCK_STREAM, 0);
	if (s < 0) return -1;
	if (connect(s, (struct sockaddr *)&g_dst, sizeof g_dst)) { int e = errno; close(s); errno = e; return -1; }
	return s;
}

/* read the server header; returns the peer the server saw in peer (IP only) */
static int read_hdr(int s, char *peer, size_t n)
{
	char h[HDR + 1];
	if (read_full(s, h, HDR)) return -1;
	h[HDR] = 0;
	if (strncmp(h, "SKCK peer=", 10)) return -1;
	char *p = h + 10, *c = strchr(p, ':');
	if (!c) return -1;
	*c = 0;
	snprintf(peer, n, "%s", p);
	return 0;
}

static int echo_check(int s, size_t n)
{
	char *out = malloc(n), *in = malloc(n);
	int r = -1;
	if (!out || !in) goto done;
	for (size_t i = 0; i < n; i++) out[i] = (char)(i * 7 + (i >> 8) + 1);
	if (write_full(s, out, n) || read_full(s, in, n)) goto done;
	r = memcmp(in, out, n) ? -2 : 0;
done:
	free(out);
	free(in);
	return r;
}

static uint64_t cookie(int s)
{
	uint64_t c = 0;
	socklen_t l = sizeof c;
	if (getsockopt(s, SOL_SOCKET, SO_NETNS_COOKIE, &c, &l)) return 0;
	return c;
}

static void check_blocking(int quick)
{
	const char *name = "blocking-connect-echo";
	int s = conn_blocking();
	if (s < 0) { fail(name, "connect: %s", strerror(errno)); return; }
	char peer[64], names[160];
	if (read_hdr(s, peer, sizeof peer)) { fail(name, "bad server header"); close(s); return; }
	int r = echo_check(s, 8192);
	if (r) fail(name, "echo of 8192 bytes %s", r == -2 ? "corrupted" : "failed");
	else ok(name);
	if (quick) { close(s); return; }
	if (check_names("client-names", s, names, sizeof names) == 0) ok("client-names");
	printf("info client %s server-saw-peer=%s\n", names, peer);
	if (g_server_peer) {
		if (strcmp(peer, g_server_peer)) fail("server-peer", "server saw %s, want %s", peer, g_server_peer);
		else ok("server-peer");
	}
	if (g_host) {
		int u = socket(AF_INET, SOCK_DGRAM, 0);
		uint64_t cs = cookie(s), cu = cookie(u);
		close(u);
		int is_host = cs && cu && cs != cu;
		if (is_host != !strcmp(g_host, "yes"))
			fail("netns", "socket netns cookie %llu, process netns cookie %llu, want host=%s",
			     (unsigned long long)cs, (unsigned long long)cu, g_host);
		else
			ok("netns");
	}
	close(s);
}

static void check_nonblocking_epoll(void)
{
	const char *name = "nonblock-connect-epoll";
	int s = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (s < 0) { fail(name, "socket: %s", strerror(errno)); return; }
	int fl = fcntl(s, F_GETFL), fdf = fcntl(s, F_GETFD);
	if (!(fl & O_NONBLOCK) || !(fdf & FD_CLOEXEC)) fail("socket-flags", "F_GETFL=%#x F_GETFD=%#x", fl, fdf);
	else ok("socket-flags");
	int r = connect(s, (struct sockaddr *)&g_dst, sizeof g_dst);
	if (r < 0 && errno != EINPROGRESS) { fail(name, "connect: %s", strerror(errno)); close(s); return; }
	int ep = epoll_create1(EPOLL_CLOEXEC);
	struct epoll_event ev = { .events = EPOLLOUT, .data.fd = s };
	epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
	int n = epoll_wait(ep, &ev, 1, 5000);
	int err = -1;
	socklen_t el = sizeof err;
	getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &el);
	if (n != 1 || !(ev.events & EPOLLOUT) || err != 0) {
		fail(name, "epoll n=%d events=%#x SO_ERROR=%d (%s) connect-ret=%d", n, ev.events, err, strerror(err), r);
		close(ep); close(s); return;
	}
	/* wait for the header with epoll, then echo */
	ev.events = EPOLLIN;
	epoll_ctl(ep, EPOLL_CTL_MOD, s, &ev);
	if (epoll_wait(ep, &ev, 1, 5000) != 1) { fail(name, "no EPOLLIN"); close(ep); close(s); return; }
	fcntl(s, F_SETFL, fl & ~O_NONBLOCK);
	char peer[64];
	if (read_hdr(s, peer, sizeof peer) || echo_check(s, 1000)) fail(name, "echo");
	else ok(name);
	close(ep);
	close(s);
}

/* An event loop (Netty's epoll transport, for one) registers a socket
 * before it connects: the registration must survive a fallback, which puts
 * a container socket under the same number. */
static void check_epoll_before_connect(void)
{
	const char *name = "epoll-before-connect";
	int s = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (s < 0) { fail(name, "socket: %s", strerror(errno)); return; }
	int ep = epoll_create1(EPOLL_CLOEXEC);
	struct epoll_event ev = { .events = EPOLLIN, .data.u64 = 7 };
	epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
	ev.events = EPOLLOUT;
	epoll_ctl(ep, EPOLL_CTL_MOD, s, &ev);
	int r = connect(s, (struct sockaddr *)&g_dst, sizeof g_dst);
	if (r < 0 && errno != EINPROGRESS) { fail(name, "connect: %s", strerror(errno)); close(ep); close(s); return; }
	struct epoll_event got = { 0 };
	int n = epoll_wait(ep, &got, 1, 5000);
	int err = -1;
	socklen_t el = sizeof err;
	getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &el);
	if (n != 1 || got.data.u64 != 7 || !(got.events & EPOLLOUT) || err != 0)
		fail(name, "epoll n=%d data=%llu events=%#x SO_ERROR=%d", n, (unsigned long long)got.data.u64, got.events, err);
	else if (epoll_ctl(ep, EPOLL_CTL_MOD, s, &ev) != 0)
		fail(name, "registration gone: %s", strerror(errno));
	else
		ok(name);
	close(ep);
	close(s);
}

static void check_select_poll(void)
{
	const char *name = "select-poll";
	int s = conn_blocking();
	char peer[64];
	if (s < 0 || read_hdr(s, peer, sizeof peer)) { fail(name, "connect: %s", strerror(errno)); if (s >= 0) close(s); return; }
	char b[16];
	if (write_full(s, "ping", 4)) { fail(name, "write"); close(s); return; }
	fd_set rf;
	FD_ZERO(&rf);
	FD_SET(s, &rf);
	struct timeval tv = { 5, 0 };
	int r = select(s + 1, &rf, NULL, NULL, &tv);
	if (r != 1 || !FD_ISSET(s, &rf) || read_full(s, b, 4) || memcmp(b, "ping", 4)) { fail(name, "select r=%d", r); close(s); return; }
	if (write_full(s, "pong", 4)) { fail(name, "write"); close(s); return; }
	struct pollfd p = { .fd = s, .events = POLLIN };
	r = poll(&p, 1, 5000);
	if (r != 1 || !(p.revents & POLLIN) || read_full(s, b, 4) || memcmp(b, "pong", 4)) { fail(name, "poll r=%d", r); close(s); return; }
	/* writable too */
	p.events = POLLOUT;
	if (poll(&p, 1, 1000) != 1 || !(p.revents & POLLOUT)) { fail(name, "not writable"); close(s); return; }
	ok(name);
	close(s);
}

static void check_fork(void)
{
	const char *name = "fork-after-connect";
	int s = conn_blocking();
	char peer[64];
	if (s < 0 || read_hdr(s, peer, sizeof peer)) { fail(name, "connect: %s", strerror(errno)); if (s >= 0) close(s); return; }
	fflush(stdout);
	pid_t p = fork();
	if (p == 0) {
		_exit(write_full(s, "from-child", 10) ? 1 : 0);
	}
	int st = 0;
	waitpid(p, &st, 0);
	char b[16];
	if (!WIFEXITED(st) || WEXITSTATUS(st) || read_full(s, b, 10) || memcmp(b, "from-child", 10))
		fail(name, "child status %#x / echo mismatch", st);
	else
		ok(name);
	close(s);
	/* the child of a fork gets sockets of its own (own pool / broker connection) */
	p = fork();
	if (p == 0) {
		int c = conn_blocking();
		_exit(c >= 0 && read_hdr(c, peer, sizeof peer) == 0 && echo_check(c, 100) == 0 ? 0 : 1);
	}
	waitpid(p, &st, 0);
	if (!WIFEXITED(st) || WEXITSTATUS(st)) fail("fork-child-connect", "child status %#x", st);
	else ok("fork-child-connect");
}

static void check_dup2(void)
{
	const char *name = "dup2-to-100";
	int s = socket(AF_INET, SOCK_STREAM, 0);
	if (s < 0) { fail(name, "socket"); return; }
	/* dup2 BEFORE connect: the shim must follow the socket to fd 100 */
	if (dup2(s, 100) != 100) { fail(name, "dup2: %s", strerror(errno)); close(s); return; }
	close(s);
	if (connect(100, (struct sockaddr *)&g_dst, sizeof g_dst)) { fail(name, "connect(100): %s", strerror(errno)); close(100); return; }
	char peer[64];
	if (read_hdr(100, peer, sizeof peer) || echo_check(100, 3000)) fail(name, "echo");
	else ok(name);
	/* and after connect */
	int c = conn_blocking();
	if (c < 0 || dup2(c, 100) != 100) { fail("dup2-after-connect", "%s", strerror(errno)); return; }
	close(c);
	if (read_hdr(100, peer, sizeof peer) || echo_check(100, 3000)) fail("dup2-after-connect", "echo");
	else ok("dup2-after-connect");
	close(100);
}

static void check_errors(void)
{
	/* errno semantics kept: EBADF, ENOTSOCK, EISCONN */
	errno = 0;
	if (connect(12345, (struct sockaddr *)&g_dst, sizeof g_dst) == 0 || errno != EBADF) fail("errno-ebadf", "errno=%d", errno);
	else ok("errno-ebadf");
	int s = conn_blocking();
	if (s < 0) { fail("errno-eisconn", "connect"); return; }
	errno = 0;
	if (connect(s, (struct sockaddr *)&g_dst, sizeof g_dst) == 0 || errno != EISCONN) fail("errno-eisconn", "errno=%d", errno);
	else ok("errno-eisconn");
	close(s);
	/* socket fd numbering: lowest free fd, like socket() */
	int a = socket(AF_INET, SOCK_STREAM, 0), b = socket(AF_INET, SOCK_STREAM, 0);
	close(a);
	int c = socket(AF_INET, SOCK_STREAM, 0);
	if (c != a) fail("lowest-fd", "got %d after closing %d", c, a);
	else ok("lowest-fd");
	close(b);
	close(c);
}

static int count_fds(int below)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *e;
	int n = 0;
	if (!d) return -1;
	while ((e = readdir(d)))
		if (e->d_name[0] != '.' && atoi(e->d_name) < below && atoi(e->d_name) != dirfd(d)) n++;
	closedir(d);
	return n;
}

static int do_loop(int n)
{
	int before = -1, fails = 0;
	for (int i = 0; i < n; i++) {
		int s = conn_blocking();
		char peer[64];
		if (s < 0 || read_hdr(s, peer, sizeof peer) || echo_check(s, 16)) {
			if (fails++ < 3) fprintf(stderr, "loop %d: %s\n", i, strerror(errno));
		}
		if (s >= 0) close(s);
		if (i == 0) before = count_fds(600);   /* after the shim set up its pool */
	}
	int after = count_fds(600), all = count_fds(1 << 30);
	printf("info loop n=%d failed=%d fds(<600) before=%d after=%d total=%d\n", n, fails, before, after, all);
	if (fails) fail("loop", "%d of %d connections failed", fails, n);
	else if (after != before || all > before + 80) fail("loop-fds", "fd leak: before=%d after=%d total=%d", before, after, all);
	else ok("loop");
	return g_fail;
}

struct targ { int n, bad; };
static void *thr(void *p)
{
	struct targ *t = p;
	for (int i = 0; i < t->n; i++) {
		int s = conn_blocking();
		char peer[64];
		if (s < 0 || read_hdr(s, peer, sizeof peer) || echo_check(s, 64)) t->bad++;
		if (s >= 0) close(s);
	}
	return NULL;
}

static int do_threads(int nt, int n)
{
	pthread_t th[256];
	struct targ a[256];
	if (nt > 256) nt = 256;
	for (int i = 0; i < nt; i++) { a[i].n = n; a[i].bad = 0; pthread_create(&th[i], NULL, thr, &a[i]); }
	int bad = 0;
	for (int i = 0; i < nt; i++) { pthread_join(th[i], NULL); bad += a[i].bad; }
	if (bad) fail("threads", "%d of %d connections failed", bad, nt * n);
	else ok("threads");
	return g_fail;
}

/* A storm of signals on the calling thread: sig, handled by h, every
 * `every` µs from a thread of its own, until the process exits. */
static struct storm { pthread_t target; int sig; useconds_t every; } g_storm;
static void *storm_main(void *a)
{
	(void)a;
	for (;;) { pthread_kill(g_storm.target, g_storm.sig); usleep(g_storm.every); }
	return NULL;
}

static void signal_storm(int sig, void (*h)(int), useconds_t every)
{
	g_storm = (struct storm){ .target = pthread_self(), .sig = sig, .every = every };
	struct sigaction sa = { .sa_handler = h, .sa_flags = SA_RESTART };
	sigaction(sig, &sa, NULL);
	pthread_t t;
	pthread_create(&t, NULL, storm_main, NULL);
}

/* forksig: a signal handler that calls close() while the process forks
 * (the shim's fork handlers hold its locks) must not deadlock. */
static void on_usr1(int sig) { (void)sig; close(-1); }

static int do_forksig(int n)
{
	int s = socket(AF_INET, SOCK_STREAM, 0);   /* one socket the shim tracks */
	signal_storm(SIGUSR1, on_usr1, 50);
	for (int i = 0; i < n; i++) {
		pid_t p = fork();
		if (p == 0) _exit(0);
		if (p < 0) { fail("forksig", "fork: %s", strerror(errno)); return g_fail; }
		while (waitpid(p, NULL, 0) < 0 && errno == EINTR) {}
	}
	close(s);
	ok("forksig");
	return g_fail;
}

/* sigmalloc: a signal handler may call dup() and close() (async-signal-
 * safe) while the thread it interrupted is inside malloc: the shim must not
 * allocate in them. The socket carries eight options, so a copy of its
 * entry is too big for malloc's per-thread cache and takes the arena lock. */
static int g_tracked;
static void on_usr2(int sig)
{
	(void)sig;
	int e = errno, d = dup(g_tracked);
	if (d >= 0) close(d);
	errno = e;
}

static int do_sigmalloc(int n)
{
	static const int opts[][2] = {
		{ SOL_SOCKET, SO_KEEPALIVE }, { SOL_SOCKET, SO_REUSEADDR }, { SOL_SOCKET, SO_SNDBUF },
		{ SOL_SOCKET, SO_RCVBUF }, { IPPROTO_TCP, TCP_NODELAY }, { IPPROTO_TCP, TCP_KEEPIDLE },
		{ IPPROTO_TCP, TCP_KEEPINTVL }, { IPPROTO_TCP, TCP_KEEPCNT },
	};
	g_tracked = socket(AF_INET, SOCK_STREAM, 0);
	for (unsigned i = 0; i < sizeof opts / sizeof opts[0]; i++) {
		int v = 100;
		if (setsockopt(g_tracked, opts[i][0], opts[i][1], &v, sizeof v) < 0) {
			fail("sigmalloc", "setsockopt %u: %s", i, strerror(errno));
			return g_fail;
		}
	}
	signal_storm(SIGUSR2, on_usr2, 20);
	for (int i = 0; i < n; i++) {
		char *p = malloc(1500 + (i % 2048));
		__asm__ volatile("" : : "r"(p) : "memory");   /* kept: not folded away */
		free(p);
	}
	close(g_tracked);
	ok("sigmalloc");
	return g_fail;
}

/* relisten: two sockets bound to one port (SO_REUSEADDR) while neither
 * listens; the second's listen() fails (EADDRINUSE), again and again. */
static int do_relisten(int n)
{
	struct sockaddr_in any = { .sin_family = AF_INET, .sin_port = g_dst.sin_port };
	int s[2], one = 1;
	for (int i = 0; i < 2; i++) {
		s[i] = socket(AF_INET, SOCK_STREAM, 0);
		if (s[i] < 0 || setsockopt(s[i], SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 ||
		    bind(s[i], (struct sockaddr *)&any, sizeof any) < 0) {
			fail("relisten", "socket %d: %s", i, strerror(errno));
			return g_fail;
		}
	}
	if (listen(s[0], 8) < 0) { fail("relisten", "listen: %s", strerror(errno)); return g_fail; }
	for (int i = 0; i < n; i++)
		if (listen(s[1], 8) == 0 || errno != EADDRINUSE) {
			fail("relisten", "second listen %d: %s, want EADDRINUSE", i, strerror(errno));
			return g_fail;
		}
	close(s[0]);
	close(s[1]);
	ok("relisten");
	return g_fail;
}

/* locks: the app puts a locked file at the numbers where the shim pools
 * its sockets (bash's "exec 800>file" does that); socket() must leave the
 * file where it is, and its lock held. */
static int do_locks(void)
{
	int s = socket(AF_INET, SOCK_STREAM, 0);   /* the pool fills */
	char path[] = "/tmp/sockcheck-lock.XXXXXX";
	int f = mkstemp(path);
	if (s < 0 || f < 0) { fail("locks", "setup: %s", strerror(errno)); return g_fail; }
	unlink(path);
	struct flock fl = { .l_type = F_WRLCK, .l_whence = SEEK_SET };
	if (fcntl(f, F_SETLK, &fl) < 0) { fail("locks", "lock: %s", strerror(errno)); return g_fail; }
	struct stat fst;
	fstat(f, &fst);
	int placed[64], np = 0;
	for (int fd = 100; fd < 4096 && np < 64; fd++) {
		int dom = 0;
		socklen_t l = sizeof dom;
		if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &dom, &l) == 0 && dom == AF_INET && dup2(f, fd) == fd)
			placed[np++] = fd;
	}
	if (!np) { fail("locks", "no pooled socket above fd 100"); return g_fail; }
	int got[80], ng = 0, bad = 0;
	for (; ng < 80; ng++) {
		struct stat st;
		got[ng] = socket(AF_INET, SOCK_STREAM, 0);
		if (got[ng] < 0 || fstat(got[ng], &st) < 0 || !S_ISSOCK(st.st_mode)) bad++;
	}
	for (int i = 0; i < np; i++) {
		struct stat st;
		if (fstat(placed[i], &st) < 0 || st.st_dev != fst.st_dev || st.st_ino != fst.st_ino) {
			fail("locks", "the app's file at fd %d is gone", placed[i]);
			return g_fail;
		}
	}
	pid_t p = fork();
	if (p == 0) {
		struct flock q = { .l_type = F_WRLCK, .l_whence = SEEK_SET };
		_exit(fcntl(f, F_GETLK, &q) == 0 && q.l_type == F_WRLCK ? 0 : 1);
	}
	int status = 1;
	while (p > 0 && waitpid(p, &status, 0) < 0 && errno == EINTR) {}
	for (int i = 0; i < ng; i++) if (got[i] >= 0) close(got[i]);
	if (bad) fail("locks", "%d of %d socket() calls gave no socket", bad, ng);
	else if (!WIFEXITED(status) || WEXITSTATUS(status)) fail("locks", "the app's lock was released (file at %d pool numbers)", np);
	else ok("locks");
	return g_fail;
}

/* holes: the app's files sit between free low numbers, where each batch of
 * sockets lands before the shim moves it up to its pool and closes the
 * numbers it arrived at (by ranges). socket() must leave every file of the
 * app's where it is and leak none of those numbers. */
#define HOLES_BELOW 700   /* under the pool's numbers (768 and up) */
static int do_holes(void)
{
	int app[48], na = 0;
	ino_t ino[48];
	for (int i = 0; i < 48; i++) {   /* files at 48 consecutive numbers, */
		app[i] = memfd_create("holes", MFD_CLOEXEC);
		if (app[i] < 0) { fail("holes", "memfd_create: %s", strerror(errno)); return g_fail; }
	}
	for (int i = 0; i < 48; i++) {   /* every other one closed */
		struct stat st;
		if (i % 2) { close(app[i]); continue; }
		fstat(app[i], &st);
		app[na] = app[i];
		ino[na++] = st.st_ino;
	}
	char before[HOLES_BELOW];
	for (int fd = 0; fd < HOLES_BELOW; fd++)
		before[fd] = fcntl(fd, F_GETFD) >= 0;
	int got[100], bad = 0;
	for (int i = 0; i < 100; i++) {   /* several batches */
		struct stat st;
		got[i] = socket(AF_INET, SOCK_STREAM, 0);
		if (got[i] < 0 || fstat(got[i], &st) < 0 || !S_ISSOCK(st.st_mode)) bad++;
	}
	/* The first batch arrived at the lowest free numbers, the holes: its
	 * first socket is the first socket()'s, at the first hole. */
	if (got[0] != app[0] + 1) {
		fail("holes", "the first socket() gave fd %d, want the lowest free %d", got[0], app[0] + 1);
		return g_fail;
	}
	for (int i = 0; i < na; i++) {
		struct stat st;
		if (fstat(app[i], &st) < 0 || st.st_ino != ino[i]) {
			fail("holes", "the app's file at fd %d is gone", app[i]);
			return g_fail;
		}
	}
	for (int i = 0; i < 100; i++) if (got[i] >= 0) close(got[i]);
	int leaked = 0, first = -1;
	for (int fd = 0; fd < HOLES_BELOW; fd++)
		if ((fcntl(fd, F_GETFD) >= 0) != before[fd] && !leaked++) first = fd;
	if (bad) fail("holes", "%d of 100 socket() calls gave no socket", bad);
	else if (leaked) fail("holes", "%d numbers below %d changed, the first %d", leaked, HOLES_BELOW, first);
	else ok("holes");
	for (int i = 0; i < na; i++) close(app[i]);
	return g_fail;
}

static void usage(void)
{
	fprintf(stderr, "usage: sockcheck server IP PORT [--count N] [--expect-net CIDR]\n"
		"       sockcheck client IP PORT [--expect-net CIDR] [--server-peer IP] [--host yes|no] [--quick]\n"
		"       sockcheck loop IP PORT N\n"
		"       sockcheck threads IP PORT NTHREADS NCONN\n"
		"       sockcheck forksig IP PORT NFORKS\n"
		"       sockcheck locks IP PORT\n"
		"       sockcheck holes IP PORT\n"
		"       sockcheck relisten IP PORT NLISTENS\n"
		"       sockcheck sigmalloc IP PORT NMALLOCS\n");
	exit(2);
}

int main(int argc, char **argv)
{
	if (argc < 4) usage();
	const char *mode = argv[1];
	g_dst.sin_family = AF_INET;
	g_dst.sin_port = htons(atoi(argv[3]));
	if (inet_pton(AF_INET, argv[2], &g_dst.sin_addr) != 1) usage();
	int count = 0, quick = 0, i = 4;
	int pos[2] = { 0, 0 }, npos = 0;
	for (; i < argc; i++) {
		if (!strcmp(argv[i], "--count") && i + 1 < argc) count = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--expect-net") && i + 1 < argc) { if (parse_cidr(argv[++i])) usage(); }
		else if (!strcmp(argv[i], "--server-peer") && i + 1 < argc) g_server_peer = argv[++i];
		else if (!strcmp(argv[i], "--host") && i + 1 < argc) g_host = argv[++i];
		else if (!strcmp(argv[i], "--quick")) quick = 1;
		else if (argv[i][0] != '-' && npos < 2) pos[npos++] = atoi(argv[i]);
		else usage();
	}
	signal(SIGPIPE, SIG_IGN);
	if (!strcmp(mode, "server")) return do_server(count);
	if (!strcmp(mode, "loop")) return do_loop(npos ? pos[0] : 100);
	if (!strcmp(mode, "threads")) return do_threads(npos > 0 ? pos[0] : 8, npos > 1 ? pos[1] : 50);
	if (!strcmp(mode, "forksig")) return do_forksig(npos ? pos[0] : 1000);
	if (!strcmp(mode, "locks")) return do_locks();
	if (!strcmp(mode, "holes")) return do_holes();
	if (!strcmp(mode, "relisten")) return do_relisten(npos ? pos[0] : 3);
	if (!strcmp(mode, "sigmalloc")) return do_sigmalloc(npos ? pos[0] : 1000000);
	if (strcmp(mode, "client")) usage();
	check_blocking(quick);
	if (!quick) {
		check_nonblocking_epoll();
		check_epoll_before_connect();
		check_select_poll();
		check_fork();
		check_dup2();
		check_errors();
	}
	return g_fail;
}
