/* Helpers shared by client and server: memory, I/O, sockets, samples, patterns. */
#include "perf.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* ---- memory ---------------------------------------------------------------- */

static void out_of_memory(void)
{
	fputs("skiff-perf: out of memory\n", stderr);
	exit(EXIT_ERRORS);
}

void *xmalloc(size_t n)
{
	void *p = malloc(n ? n : 1);

	if (!p)
		out_of_memory();
	return p;
}

void *xcalloc(size_t n, size_t size)
{
	void *p = calloc(n ? n : 1, size ? size : 1);

	if (!p)
		out_of_memory();
	return p;
}

void *xrealloc(void *p, size_t n)
{
	void *q = realloc(p, n ? n : 1);

	if (!q)
		out_of_memory();
	return q;
}

/* ---- samples ------------------------------------------------------------------ */

void samples_grow(struct samples *s)
{
	size_t cap = s->cap ? s->cap * 2 : 65536;

	s->v = xrealloc(s->v, cap * sizeof(*s->v));
	s->cap = cap;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return (x > y) - (x < y);
}

/* Nearest rank percentile, q in units of 1/10000 (exact integer arithmetic). */
static double percentile_us(const struct samples *s, uint64_t q)
{
	uint64_t rank = (s->n * q + 9999) / 10000; /* ceil(n * q) */

	if (rank == 0)
		rank = 1;
	return (double)s->v[rank - 1] / 1000.0;
}

struct latency_summary samples_summarize(struct samples *s)
{
	struct latency_summary r = { 0 };
	double sum = 0;

	if (s->n == 0)
		return r;
	qsort(s->v, s->n, sizeof(*s->v), cmp_u64);
	for (size_t i = 0; i < s->n; i++)
		sum += (double)s->v[i];
	r.p50_us = percentile_us(s, 5000);
	r.p90_us = percentile_us(s, 9000);
	r.p99_us = percentile_us(s, 9900);
	r.p999_us = percentile_us(s, 9990);
	r.min_us = (double)s->v[0] / 1000.0;
	r.max_us = (double)s->v[s->n - 1] / 1000.0;
	r.mean_us = sum / (double)s->n / 1000.0;
	return r;
}

/* ---- I/O --------------------------------------------------------------------- */

ssize_t read_full(int fd, void *buf, size_t len)
{
	size_t got = 0;

	while (got < len) {
		ssize_t r = read(fd, (char *)buf + got, len - got);

		if (r > 0)
			got += (size_t)r;
		else if (r == 0)
			break;
		else if (errno != EINTR)
			return -1;
	}
	return (ssize_t)got;
}

int write_all(int fd, const void *buf, size_t len)
{
	const char *p = buf;

	while (len > 0) {
		ssize_t r = write(fd, p, len);

		if (r >= 0) {
			p += r;
			len -= (size_t)r;
		} else if (errno != EINTR) {
			return -1;
		}
	}
	return 0;
}

/* ---- sockets ----------------------------------------------------------------- */

int set_nodelay(int fd)
{
	int one = 1;

	return setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

static struct timeval ms_to_timeval(unsigned ms)
{
	struct timeval tv = { .tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000 };

	return tv;
}

int set_timeouts(int fd, unsigned rcv_ms, unsigned snd_ms)
{
	struct timeval rcv = ms_to_timeval(rcv_ms), snd = ms_to_timeval(snd_ms);

	if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &rcv, sizeof(rcv)) < 0)
		return -1;
	return setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &snd, sizeof(snd));
}

int tcp_socket(int family)
{
	int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);

	if (fd < 0)
		return -1;
	/* SO_SNDTIMEO also bounds connect() on Linux. */
	if (set_nodelay(fd) < 0 || set_timeouts(fd, IO_TIMEOUT_MS, IO_TIMEOUT_MS) < 0) {
		int e = errno;

		close(fd);
		errno = e;
		return -1;
	}
	return fd;
}

int connect_fd(int fd, const struct sockaddr *sa, socklen_t len)
{
	struct pollfd p = { .fd = fd, .events = POLLOUT };
	int err = 0, r;
	socklen_t errlen = sizeof(err);

	if (connect(fd, sa, len) == 0)
		return 0;
	if (errno == EINPROGRESS) { /* SO_SNDTIMEO expired */
		errno = ETIMEDOUT;
		return -1;
	}
	if (errno != EINTR)
		return -1;
	/* After EINTR the handshake goes on asynchronously: wait for its outcome. */
	do
		r = poll(&p, 1, IO_TIMEOUT_MS);
	while (r < 0 && errno == EINTR);
	if (r < 0)
		return -1;
	if (r == 0) {
		errno = ETIMEDOUT;
		return -1;
	}
	if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &errlen) < 0)
		return -1;
	if (err) {
		errno = err;
		return -1;
	}
	return 0;
}

int tcp_connect(const struct sockaddr_storage *ss, socklen_t len)
{
	int fd = tcp_socket(ss->ss_family);

	if (fd < 0)
		return -1;
	if (connect_fd(fd, (const struct sockaddr *)ss, len) < 0) {
		int e = errno;

		close(fd);
		errno = e;
		return -1;
	}
	return fd;
}

int resolve_host(const char *host, bool passive, struct sockaddr_storage *ss, socklen_t *len)
{
	struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM };
	struct addrinfo *res;
	int rc;

	hints.ai_flags = passive ? AI_PASSIVE | AI_NUMERICHOST : 0;
	rc = getaddrinfo(host, NULL, &hints, &res);
	if (rc != 0)
		return rc;
	memcpy(ss, res->ai_addr, res->ai_addrlen);
	*len = res->ai_addrlen;
	freeaddrinfo(res);
	return 0;
}

void sockaddr_set_port(struct sockaddr_storage *ss, int port)
{
	if (ss->ss_family == AF_INET6)
		((struct sockaddr_in6 *)ss)->sin6_port = htons((uint16_t)port);
	else
		((struct sockaddr_in *)ss)->sin_port = htons((uint16_t)port);
}

/* ---- pattern ------------------------------------------------------------------ */

static uint8_t mix8(uint64_t x)
{
	x *= 0x9E3779B97F4A7C15ull;
	x ^= x >> 29;
	return (uint8_t)(x >> 56);
}

void pattern_init(struct pattern *p, size_t size)
{
	p->size = size;
	p->base = xmalloc(size);
	for (size_t i = 0; i < size; i++)
		p->base[i] = mix8(i + 1);
}

void pattern_free(struct pattern *p)
{
	free(p->base);
	p->base = NULL;
}

static uint8_t txn_byte(uint64_t n)
{
	return mix8(n ^ 0x5bd1e995u);
}

uint8_t pattern_byte(const struct pattern *p, uint64_t n, size_t i)
{
	if (i < 8)
		return (uint8_t)(n >> (8 * i));
	return p->base[i] ^ txn_byte(n);
}

void pattern_fill(const struct pattern *p, uint64_t n, uint8_t *out)
{
	size_t head = p->size < 8 ? p->size : 8;
	uint8_t t = txn_byte(n);

	for (size_t i = 0; i < head; i++)
		out[i] = (uint8_t)(n >> (8 * i));
	for (size_t i = 8; i < p->size; i++)
		out[i] = p->base[i] ^ t;
}

bool pattern_check(const struct pattern *p, uint64_t n, const uint8_t *resp, size_t *bad)
{
	size_t head = p->size < 8 ? p->size : 8;
	uint8_t t = txn_byte(n) ^ RESPONSE_XOR;
	size_t i;

	for (i = 0; i < head; i++)
		if (resp[i] != (uint8_t)((uint8_t)(n >> (8 * i)) ^ RESPONSE_XOR))
			goto mismatch;
	for (; i < p->size; i++)
		if (resp[i] != (p->base[i] ^ t))
			goto mismatch;
	return true;
mismatch:
	*bad = i;
	return false;
}

void proto_encode_header(uint8_t hdr[PROTO_HDR_LEN], uint8_t mode, uint32_t size)
{
	memcpy(hdr, PROTO_MAGIC, 4);
	hdr[4] = mode;
	hdr[5] = (uint8_t)(size >> 16);
	hdr[6] = (uint8_t)(size >> 8);
	hdr[7] = (uint8_t)size;
}
