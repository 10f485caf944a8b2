/*
 * The reflector server.
 *
 *   tcp/P    header, then: read SIZE bytes, answer SIZE transformed bytes.
 *            rr mode repeats until EOF; crr mode closes right after the first
 *            response, so TIME_WAIT lands here and not on the client's ports.
 *            Served by a pool of threads that each block in accept() and then
 *            serve one connection at a time; the pool grows whenever its last
 *            idle thread takes a connection, so every connection has a thread
 *            and a tcp_crr run does not pay for a thread creation per connect.
 *   tcp/P+1  connect latency: one epoll thread accepts, writes CONNECT_BYTE at
 *            once and closes when the peer has closed.
 *   udp/P    one thread: recvfrom, transform, sendto.
 *
 * The main thread waits for SIGTERM/SIGINT and exits 0.
 */
#include "perf.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

#define LISTEN_BACKLOG  1024
#define MAX_TCP_THREADS 1024
#define MAX_IDLE        16   /* idle pool threads beyond this exit */
#define INITIAL_THREADS 4
#define INBUF_MIN       4096

struct server {
	uint64_t corrupt_every;
	atomic_uint_fast64_t responses; /* only counted with corrupt_every */
	int tcp_fd, connect_fd, udp_fd;
	atomic_int idle, threads;       /* tcp pool */
	atomic_bool pool_full_logged;
};

/* Test only: true for every corrupt_every-th response of the whole server. */
static bool should_corrupt(struct server *s)
{
	if (s->corrupt_every == 0)
		return false;
	return (atomic_fetch_add(&s->responses, 1) + 1) % s->corrupt_every == 0;
}

/* Turns a request into its response in place. */
static void transform(struct server *s, uint8_t *buf, size_t len)
{
	for (size_t i = 0; i < len; i++)
		buf[i] ^= RESPONSE_XOR;
	if (len > 0 && should_corrupt(s))
		buf[len - 1] ^= 0xFF;
}

/* ---- tcp/P: request/response ---------------------------------------------------- */

/* Receive buffer of one connection: unconsumed bytes are buf[start, end). */
struct inbuf {
	uint8_t *buf;
	size_t cap, start, end;
};

/* Makes at least need bytes available; 1 ok, 0 EOF, -1 error. */
static int inbuf_fill(int fd, struct inbuf *in, size_t need)
{
	while (in->end - in->start < need) {
		ssize_t r;

		if (in->start + need > in->cap) {
			memmove(in->buf, in->buf + in->start, in->end - in->start);
			in->end -= in->start;
			in->start = 0;
		}
		r = read(fd, in->buf + in->end, in->cap - in->end);
		if (r > 0)
			in->end += (size_t)r;
		else if (r == 0)
			return 0;
		else if (errno != EINTR)
			return -1;
	}
	return 1;
}

static bool parse_header(const uint8_t *h, uint8_t *mode, uint32_t *size)
{
	if (memcmp(h, PROTO_MAGIC, 4) != 0)
		return false;
	*mode = h[4];
	*size = (uint32_t)h[5] << 16 | (uint32_t)h[6] << 8 | h[7];
	return (*mode == PROTO_MODE_RR || *mode == PROTO_MODE_CRR) &&
	       *size >= 1 && *size <= MAX_TCP_SIZE;
}

/*
 * Serves one connection.  In steady state a transaction costs exactly one
 * read() and one write(): the read asks for as much as fits, so a whole
 * request (and in crr mode the header with it) arrives in one call.
 */
static void serve_tcp(struct server *s, int fd)
{
	struct inbuf in = { .cap = INBUF_MIN };
	uint8_t mode;
	uint32_t size;

	in.buf = xmalloc(in.cap);
	if (inbuf_fill(fd, &in, PROTO_HDR_LEN) <= 0)
		goto out; /* e.g. a client's reachability probe */
	if (!parse_header(in.buf + in.start, &mode, &size)) {
		fputs("skiff-perf server: dropping connection with a bad header\n", stderr);
		goto out;
	}
	in.start += PROTO_HDR_LEN;
	if (in.cap < PROTO_HDR_LEN + (size_t)size) {
		in.cap = PROTO_HDR_LEN + (size_t)size;
		in.buf = xrealloc(in.buf, in.cap);
	}
	do {
		if (inbuf_fill(fd, &in, size) <= 0)
			break;
		transform(s, in.buf + in.start, size);
		if (write_all(fd, in.buf + in.start, size) < 0)
			break;
		in.start += size;
		if (in.start == in.end)
			in.start = in.end = 0;
	} while (mode == PROTO_MODE_RR);
out:
	free(in.buf);
}

static void spawn_tcp_thread(struct server *s);

static void *tcp_thread(void *arg)
{
	struct server *s = arg;

	for (;;) {
		int fd = accept4(s->tcp_fd, NULL, NULL, SOCK_CLOEXEC);

		if (fd < 0) {
			if (errno == EMFILE || errno == ENFILE || errno == ENOMEM ||
			    errno == ENOBUFS)
				usleep(10000); /* wait for connections to close */
			continue;
		}
		/* Last idle thread took this one: make sure the next one is served too. */
		if (atomic_fetch_sub(&s->idle, 1) == 1)
			spawn_tcp_thread(s);
		/* Linux copies TCP_NODELAY from the listener; set it anyway in case a
		 * preloaded socket shim does not. */
		set_nodelay(fd);
		serve_tcp(s, fd);
		close(fd);
		if (atomic_fetch_add(&s->idle, 1) >= MAX_IDLE) {
			atomic_fetch_sub(&s->idle, 1);
			atomic_fetch_sub(&s->threads, 1);
			return NULL;
		}
	}
}

static void spawn_tcp_thread(struct server *s)
{
	pthread_attr_t attr;
	pthread_t t;

	if (atomic_fetch_add(&s->threads, 1) >= MAX_TCP_THREADS) {
		atomic_fetch_sub(&s->threads, 1);
		if (!atomic_exchange(&s->pool_full_logged, true))
			fprintf(stderr, "skiff-perf server: %d concurrent tcp connections, "
					"further ones wait\n", MAX_TCP_THREADS);
		return;
	}
	atomic_fetch_add(&s->idle, 1);
	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	pthread_attr_setstacksize(&attr, 256 * 1024);
	if (pthread_create(&t, &attr, tcp_thread, s) != 0) {
		atomic_fetch_sub(&s->idle, 1);
		atomic_fetch_sub(&s->threads, 1);
		fputs("skiff-perf server: cannot create thread\n", stderr);
	}
	pthread_attr_destroy(&attr);
}

/* ---- tcp/P+1: connect latency ----------------------------------------------------- */

static void accept_connect_clients(struct server *s, int ep)
{
	for (;;) {
		struct epoll_event ev = { .events = EPOLLIN };
		uint8_t b = CONNECT_BYTE;
		int fd = accept4(s->connect_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);

		if (fd < 0)
			return; /* EAGAIN: drained; anything else: retry on next wakeup */
		if (should_corrupt(s))
			b ^= 0xFF;
		/* TCP_NODELAY is inherited from the listener; a fresh socket's send
		 * buffer is empty, so this write cannot block or be short. */
		if (write(fd, &b, 1) != 1) {
			close(fd);
			continue;
		}
		ev.data.fd = fd;
		if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) < 0)
			close(fd);
	}
}

static void *connect_thread(void *arg)
{
	struct server *s = arg;
	struct epoll_event ev = { .events = EPOLLIN, .data.fd = s->connect_fd };
	struct epoll_event evs[64];
	int ep = epoll_create1(EPOLL_CLOEXEC);

	if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, s->connect_fd, &ev) < 0) {
		perror("skiff-perf server: epoll");
		exit(EXIT_UNREACHABLE);
	}
	for (;;) {
		int n = epoll_wait(ep, evs, 64, -1);

		for (int i = 0; i < n; i++) {
			int fd = evs[i].data.fd;
			char junk[256];
			ssize_t r;

			if (fd == s->connect_fd) {
				accept_connect_clients(s, ep);
				continue;
			}
			r = read(fd, junk, sizeof(junk));
			if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR))
				close(fd); /* also removes it from the epoll set */
		}
	}
	return NULL;
}

/* ---- udp/P ---------------------------------------------------------------------- */

static void *udp_thread(void *arg)
{
	struct server *s = arg;
	uint8_t *buf = xmalloc(65536);

	for (;;) {
		struct sockaddr_storage peer;
		socklen_t plen = sizeof(peer);
		ssize_t r = recvfrom(s->udp_fd, buf, 65536, 0, (struct sockaddr *)&peer, &plen);

		if (r < 0)
			continue; /* EINTR, or a transient error: keep serving */
		transform(s, buf, (size_t)r);
		/* A failed send is a lost datagram for the client, as on any network. */
		(void)sendto(s->udp_fd, buf, (size_t)r, 0, (struct sockaddr *)&peer, plen);
	}
	return NULL;
}

/* ---- setup ---------------------------------------------------------------------- */

/* type: SOCK_STREAM or SOCK_DGRAM; flags: e.g. SOCK_NONBLOCK */
static int open_listener(const struct sockaddr_storage *addr, socklen_t len, int port,
			 int type, int flags)
{
	struct sockaddr_storage a = *addr;
	int one = 1;
	int fd = socket(a.ss_family, type | flags | SOCK_CLOEXEC, 0);

	sockaddr_set_port(&a, port);
	if (fd < 0)
		goto fail;
	if (type == SOCK_STREAM &&
	    (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0 ||
	     set_nodelay(fd) < 0))
		goto fail;
	if (bind(fd, (struct sockaddr *)&a, len) < 0)
		goto fail;
	if (type == SOCK_STREAM && listen(fd, LISTEN_BACKLOG) < 0)
		goto fail;
	return fd;
fail:
	fprintf(stderr, "skiff-perf server: cannot listen on %s port %d: %s\n",
		type == SOCK_STREAM ? "tcp" : "udp", port, strerror(errno));
	if (fd >= 0)
		close(fd);
	return -1;
}

static int start_thread(void *(*fn)(void *), struct server *s)
{
	pthread_t t;

	if (pthread_create(&t, NULL, fn, s) != 0)
		return -1;
	return pthread_detach(t);
}

int run_server(const struct server_config *cfg)
{
	static struct server s; /* lives until exit; threads keep pointers to it */
	struct sockaddr_storage addr;
	socklen_t len;
	sigset_t sigs;
	int rc, sig;

	rc = resolve_host(cfg->bind, true, &addr, &len);
	if (rc != 0) {
		fprintf(stderr, "skiff-perf server: bad --bind address %s: %s\n", cfg->bind,
			gai_strerror(rc));
		return EXIT_USAGE;
	}
	s.corrupt_every = cfg->corrupt_every;
	s.tcp_fd = open_listener(&addr, len, cfg->port, SOCK_STREAM, 0);
	s.connect_fd = open_listener(&addr, len, cfg->port + 1, SOCK_STREAM, SOCK_NONBLOCK);
	s.udp_fd = open_listener(&addr, len, cfg->port, SOCK_DGRAM, 0);
	if (s.tcp_fd < 0 || s.connect_fd < 0 || s.udp_fd < 0)
		return EXIT_UNREACHABLE;

	/* Threads inherit the mask, so only sigwait() below sees these signals. */
	sigemptyset(&sigs);
	sigaddset(&sigs, SIGINT);
	sigaddset(&sigs, SIGTERM);
	pthread_sigmask(SIG_BLOCK, &sigs, NULL);
	signal(SIGPIPE, SIG_IGN);

	for (int i = 0; i < INITIAL_THREADS; i++)
		spawn_tcp_thread(&s);
	if (atomic_load(&s.threads) == 0 || start_thread(connect_thread, &s) != 0 ||
	    start_thread(udp_thread, &s) != 0) {
		fputs("skiff-perf server: cannot create threads\n", stderr);
		return EXIT_UNREACHABLE;
	}
	fprintf(stderr, "skiff-perf server: ready: tcp %s:%d (rr, crr), tcp %s:%d (connect), "
		"udp %s:%d (rr)%s\n", cfg->bind, cfg->port, cfg->bind, cfg->port + 1,
		cfg->bind, cfg->port, cfg->corrupt_every ? " [TEST: corrupting responses]" : "");

	do
		rc = sigwait(&sigs, &sig);
	while (rc != 0);
	fprintf(stderr, "skiff-perf server: %s, exiting\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
	return EXIT_OK;
}
