/*
 * memcached text protocol load test against a real memcached.
 *
 * Keys are "skiff:K" for K in [0, MC_KEYS).  A SET of key K with a value of S
 * bytes always stores the same bytes, value_byte(K, S, j), with flags = K, so
 * any value a GET returns can be verified from its key and length alone (also
 * if another skiff-perf client wrote it).  The keyspace is stored once before
 * measuring, so GETs normally hit; a miss is counted, not an error.
 *
 * Each worker has one outstanding request at a time: on its own persistent
 * connection, or with --new-conn on a fresh connection per request that is
 * closed by memcached ("quit" is sent with the request) so that TIME_WAIT
 * lands on the server and the client does not run out of ephemeral ports.
 */
#include "perf.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define MC_KEYS         10000
#define MC_MAX_VALUE    1024
#define MC_SET_EVERY    11   /* one request in 11 is a SET: GET:SET = 10:1 */
#define MC_BATCH        64   /* pipelined SETs per write while pre-populating */
#define MC_MAX_REQUEST  (64 + MC_MAX_VALUE + 2 + 6)
#define MC_READER_SIZE  4096 /* holds any reply we accept, value included */

/* ---- deterministic content -------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s) /* splitmix64 */
{
	uint64_t z = (*s += 0x9E3779B97F4A7C15ull);

	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
	z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
	return z ^ (z >> 31);
}

/* Printable, so a mismatch is readable in the error message. */
static char value_byte(uint32_t key, uint32_t size, uint32_t j)
{
	uint32_t x = key * 0x9E3779B1u ^ size * 0x85EBCA6Bu ^ (j + 1) * 0xC2B2AE35u;

	x ^= x >> 16;
	x *= 0x7FEB352Du;
	x ^= x >> 15;
	return (char)('!' + x % 94);
}

static size_t build_set(char *buf, uint32_t key, uint32_t size)
{
	int n = sprintf(buf, "set skiff:%u %u 0 %u\r\n", key, key, size);
	size_t len = (size_t)n;

	for (uint32_t j = 0; j < size; j++)
		buf[len++] = value_byte(key, size, j);
	buf[len++] = '\r';
	buf[len++] = '\n';
	return len;
}

static size_t build_get(char *buf, uint32_t key)
{
	return (size_t)sprintf(buf, "get skiff:%u\r\n", key);
}

/* ---- buffered reader --------------------------------------------------------------- */

struct reader {
	int fd;
	size_t start, end;
	char buf[MC_READER_SIZE];
};

static void reader_reset(struct reader *r, int fd)
{
	r->fd = fd;
	r->start = r->end = 0;
}

/* Reads more bytes; 1 ok, 0 EOF, -1 error (errno), -2 buffer full. */
static int reader_fill(struct reader *r)
{
	ssize_t n;

	if (r->start > 0) {
		memmove(r->buf, r->buf + r->start, r->end - r->start);
		r->end -= r->start;
		r->start = 0;
	}
	if (r->end == sizeof(r->buf))
		return -2;
	do
		n = read(r->fd, r->buf + r->end, sizeof(r->buf) - r->end);
	while (n < 0 && errno == EINTR);
	if (n <= 0)
		return (int)n;
	r->end += (size_t)n;
	return 1;
}

static const char *fill_error(int rc)
{
	if (rc == 0)
		return "connection closed by the server";
	if (rc == -2)
		return "reply too long";
	if (errno == EAGAIN || errno == EWOULDBLOCK)
		return "timed out waiting for the server";
	return strerror(errno);
}

/* Next line without CRLF, NUL terminated in place; 1 ok, else as reader_fill. */
static int reader_line(struct reader *r, char **line)
{
	for (;;) {
		char *p = memmem(r->buf + r->start, r->end - r->start, "\r\n", 2);
		int rc;

		if (p) {
			*p = '\0';
			*line = r->buf + r->start;
			r->start = (size_t)(p + 2 - r->buf);
			return 1;
		}
		rc = reader_fill(r);
		if (rc <= 0)
			return rc;
	}
}

/* The next n bytes, contiguous; 1 ok, else as reader_fill. */
static int reader_block(struct reader *r, size_t n, const char **data)
{
	if (n > sizeof(r->buf))
		return -2;
	while (r->end - r->start < n) {
		int rc = reader_fill(r);

		if (rc <= 0)
			return rc;
	}
	*data = r->buf + r->start;
	r->start += n;
	return 1;
}

/* ---- replies ------------------------------------------------------------------------ */

enum mc_reply {
	MC_OK,
	MC_BAD,    /* wrong answer, but the reply was read completely */
	MC_BROKEN, /* connection unusable */
};

struct mc_result {
	bool hit;
	char why[256];
};

static enum mc_reply read_set_reply(struct reader *r, uint32_t key, struct mc_result *res)
{
	char *line;
	int rc = reader_line(r, &line);

	if (rc <= 0) {
		snprintf(res->why, sizeof(res->why), "SET skiff:%u: %s", key, fill_error(rc));
		return MC_BROKEN;
	}
	if (strcmp(line, "STORED") == 0)
		return MC_OK;
	snprintf(res->why, sizeof(res->why), "SET skiff:%u: server replied \"%.100s\"", key, line);
	return MC_BAD;
}

static bool is_error_line(const char *line)
{
	return strcmp(line, "ERROR") == 0 || strncmp(line, "SERVER_ERROR", 12) == 0 ||
	       strncmp(line, "CLIENT_ERROR", 12) == 0;
}

/* Checks a complete VALUE reply (header fields and data) against our scheme. */
static bool check_value(uint32_t key, uint32_t k, uint32_t flags, uint32_t bytes,
			const char *data, struct mc_result *res)
{
	if (k != key || flags != key || bytes < 1 || bytes > MC_MAX_VALUE) {
		snprintf(res->why, sizeof(res->why), "GET skiff:%u: got VALUE skiff:%u flags %u "
			 "of %u bytes", key, k, flags, bytes);
		return false;
	}
	for (uint32_t j = 0; j < bytes; j++) {
		char want = value_byte(key, bytes, j);

		if (data[j] != want) {
			snprintf(res->why, sizeof(res->why), "GET skiff:%u: value byte %u of %u "
				 "is 0x%02x, expected 0x%02x", key, j, bytes,
				 (uint8_t)data[j], (uint8_t)want);
			return false;
		}
	}
	return true;
}

static enum mc_reply read_get_reply(struct reader *r, uint32_t key, struct mc_result *res)
{
	uint32_t k, flags, bytes;
	const char *data;
	char *line;
	int pos = 0, rc = reader_line(r, &line);

	if (rc <= 0)
		goto broken;
	if (strcmp(line, "END") == 0) {
		res->hit = false;
		return MC_OK;
	}
	if (is_error_line(line)) {
		snprintf(res->why, sizeof(res->why), "GET skiff:%u: server replied \"%.100s\"",
			 key, line);
		return MC_BAD;
	}
	if (sscanf(line, "VALUE skiff:%u %u %u%n", &k, &flags, &bytes, &pos) != 3 ||
	    line[pos] != '\0' || bytes > MC_READER_SIZE - 2) {
		snprintf(res->why, sizeof(res->why), "GET skiff:%u: unexpected reply \"%.100s\"",
			 key, line);
		return MC_BROKEN;
	}
	rc = reader_block(r, (size_t)bytes + 2, &data);
	if (rc <= 0)
		goto broken;
	if (data[bytes] != '\r' || data[bytes + 1] != '\n') {
		snprintf(res->why, sizeof(res->why), "GET skiff:%u: value not followed by CRLF", key);
		return MC_BROKEN;
	}
	/* data points into the reader: check it before the next read moves it. */
	if (!check_value(key, k, flags, bytes, data, res)) {
		rc = reader_line(r, &line);
		return rc > 0 && strcmp(line, "END") == 0 ? MC_BAD : MC_BROKEN;
	}
	rc = reader_line(r, &line);
	if (rc <= 0)
		goto broken;
	if (strcmp(line, "END") != 0) {
		snprintf(res->why, sizeof(res->why), "GET skiff:%u: expected END, got \"%.100s\"",
			 key, line);
		return MC_BROKEN;
	}
	res->hit = true;
	return MC_OK;
broken:
	snprintf(res->why, sizeof(res->why), "GET skiff:%u: %s", key, fill_error(rc));
	return MC_BROKEN;
}

/* With --new-conn memcached must close right after the reply (we sent "quit"). */
static enum mc_reply expect_close(struct reader *r, struct mc_result *res)
{
	int rc = r->start == r->end ? reader_fill(r) : 1;

	if (rc == 0)
		return MC_OK;
	snprintf(res->why, sizeof(res->why), "after the reply: %s",
		 rc > 0 ? "unexpected data instead of the server closing" : fill_error(rc));
	return MC_BROKEN;
}

/* ---- pre-population ------------------------------------------------------------------ */

static void report_setup_error(const struct mc_result *res, uint64_t *errors)
{
	if (*errors < 20)
		fprintf(stderr, "skiff-perf: memcached: storing the keyspace: %s\n", res->why);
	(*errors)++;
}

/* Stores every key once, MC_BATCH pipelined SETs at a time. */
static int mc_setup(const struct client_config *cfg, uint64_t *errors)
{
	char *buf = xmalloc(MC_BATCH * MC_MAX_REQUEST);
	struct reader *r = xmalloc(sizeof(*r));
	uint64_t rng = 0x736b696666ull;
	int fd = tcp_connect(&cfg->addr, cfg->addrlen);

	if (fd < 0) {
		report_unreachable(cfg, cfg->port, "memcached", errno);
		free(buf);
		free(r);
		return -1;
	}
	reader_reset(r, fd);
	for (uint32_t first = 0; first < MC_KEYS; first += MC_BATCH) {
		uint32_t last = first + MC_BATCH < MC_KEYS ? first + MC_BATCH : MC_KEYS;
		struct mc_result res = { 0 };
		size_t len = 0;

		for (uint32_t k = first; k < last; k++)
			len += build_set(buf + len, k, 1 + (uint32_t)(rng_next(&rng) % MC_MAX_VALUE));
		if (write_all(fd, buf, len) < 0) {
			snprintf(res.why, sizeof(res.why), "write: %s", strerror(errno));
			report_setup_error(&res, errors);
			break;
		}
		for (uint32_t k = first; k < last; k++) {
			enum mc_reply rep = read_set_reply(r, k, &res);

			if (rep != MC_OK)
				report_setup_error(&res, errors);
			if (rep == MC_BROKEN)
				goto out;
		}
	}
out:
	close(fd);
	free(buf);
	free(r);
	return 0;
}

/* ---- the test -------------------------------------------------------------------------- */

struct mc_state {
	int fd; /* persistent connection; -1 with --new-conn */
	uint64_t rng;
	char wbuf[MC_MAX_REQUEST];
	struct reader rd;
};

static int mc_open(struct worker *w)
{
	struct mc_state *st = xcalloc(1, sizeof(*st));

	w->priv = st;
	st->rng = 0x6d656d63ull + w->id * 0x1000193ull;
	st->fd = -1;
	if (w->cfg->new_conn)
		return 0; /* mc_setup has shown that the server is reachable */
	st->fd = tcp_connect(&w->cfg->addr, w->cfg->addrlen);
	if (st->fd < 0) {
		report_unreachable(w->cfg, w->cfg->port, "memcached", errno);
		return -1;
	}
	reader_reset(&st->rd, st->fd);
	return 0;
}

static void mc_close(struct worker *w)
{
	struct mc_state *st = w->priv;

	if (st->fd >= 0)
		close(st->fd);
	free(st);
	w->priv = NULL;
}

/* Sends the request on fd and reads the reply; with --new-conn also the close. */
static enum mc_reply mc_exchange(struct worker *w, struct mc_state *st, int fd, size_t len,
				 bool is_set, uint32_t key, struct mc_result *res)
{
	enum mc_reply rep;

	if (write_all(fd, st->wbuf, len) < 0) {
		snprintf(res->why, sizeof(res->why), "write: %s", strerror(errno));
		return MC_BROKEN;
	}
	rep = is_set ? read_set_reply(&st->rd, key, res) : read_get_reply(&st->rd, key, res);
	if (rep == MC_BROKEN)
		return rep;
	if (w->cfg->new_conn) {
		enum mc_reply c = expect_close(&st->rd, res);

		return c == MC_OK ? rep : c;
	}
	if (st->rd.start != st->rd.end) {
		snprintf(res->why, sizeof(res->why), "unexpected data after the reply");
		return MC_BROKEN;
	}
	return rep;
}

static enum txn_status mc_txn(struct worker *w, uint64_t *lat_ns)
{
	struct mc_state *st = w->priv;
	uint64_t x = rng_next(&st->rng), n = w->next_txn++, t0;
	bool is_set = x % MC_SET_EVERY == 0;
	uint32_t key = (uint32_t)((x >> 8) % MC_KEYS);
	uint32_t vsize = 1 + (uint32_t)((x >> 32) % MC_MAX_VALUE);
	size_t len = is_set ? build_set(st->wbuf, key, vsize) : build_get(st->wbuf, key);
	struct mc_result res = { 0 };
	enum mc_reply rep;
	int fd = st->fd;

	if (w->cfg->new_conn) {
		memcpy(st->wbuf + len, "quit\r\n", 6);
		len += 6;
	}
	t0 = now_ns();
	if (w->cfg->new_conn) {
		fd = tcp_connect(&w->cfg->addr, w->cfg->addrlen);
		if (fd < 0) {
			report_error(w, "request %" PRIu64 ": connect: %s", n, strerror(errno));
			return TXN_FATAL;
		}
		reader_reset(&st->rd, fd);
	}
	rep = mc_exchange(w, st, fd, len, is_set, key, &res);
	if (w->cfg->new_conn)
		close(fd);
	*lat_ns = now_ns() - t0;

	if (rep != MC_OK) {
		report_error(w, "request %" PRIu64 ": %s", n, res.why);
		return rep == MC_BAD || w->cfg->new_conn ? TXN_ERROR : TXN_FATAL;
	}
	if (is_set) {
		w->cnt.sets++;
	} else {
		w->cnt.gets++;
		if (res.hit)
			w->cnt.hits++;
		else
			w->cnt.misses++;
	}
	return TXN_OK;
}

const struct test_ops memcached_test = {
	.name = "memcached",
	.default_port = MEMCACHED_DEFAULT_PORT,
	.max_size = 0,
	.multi_conn = true,
	.setup = mc_setup,
	.open = mc_open,
	.txn = mc_txn,
	.close = mc_close,
};
