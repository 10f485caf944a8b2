/* The reflector tests: tcp_rr, udp_rr, tcp_crr and connect. */
#include "perf.h"

#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* State shared by the payload tests: request, response, pattern, one socket. */
struct rr_state {
	int fd;
	struct pattern pat;
	uint8_t *req;  /* tcp_crr: header + request */
	uint8_t *resp; /* size + 1: room to see an oversized udp reply */
	/* udp_rr: transactions that timed out; their replies may still arrive. */
	uint64_t lost_ring[64];
	size_t lost_n;
};

static struct rr_state *rr_state_new(struct worker *w, size_t req_extra)
{
	struct rr_state *st = xcalloc(1, sizeof(*st));
	size_t size = w->cfg->size;

	st->fd = -1;
	pattern_init(&st->pat, size);
	st->req = xmalloc(req_extra + size);
	st->resp = xmalloc(size + 1);
	w->priv = st;
	return st;
}

static void rr_close(struct worker *w)
{
	struct rr_state *st = w->priv;

	if (st->fd >= 0)
		close(st->fd);
	pattern_free(&st->pat);
	free(st->req);
	free(st->resp);
	free(st);
	w->priv = NULL;
}

static struct sockaddr_storage addr_port(const struct client_config *cfg, int port)
{
	struct sockaddr_storage a = cfg->addr;

	sockaddr_set_port(&a, port);
	return a;
}

static const char *io_error(int err)
{
	if (err == EAGAIN || err == EWOULDBLOCK)
		return "timed out waiting for the server";
	return strerror(err);
}

/* Reads and verifies one TCP response; TXN_OK, TXN_ERROR or TXN_FATAL. */
static enum txn_status read_tcp_response(struct worker *w, struct rr_state *st, uint64_t n)
{
	size_t size = w->cfg->size, bad;
	ssize_t got = read_full(st->fd, st->resp, size);

	if (got < 0) {
		report_error(w, "transaction %" PRIu64 ": read: %s", n, io_error(errno));
		return TXN_FATAL;
	}
	if ((size_t)got < size) {
		report_error(w, "transaction %" PRIu64 ": server closed the connection after "
			     "%zd of %zu response bytes", n, got, size);
		return TXN_FATAL;
	}
	if (!pattern_check(&st->pat, n, st->resp, &bad)) {
		report_error(w, "transaction %" PRIu64 ": response byte %zu of %zu is 0x%02x, "
			     "expected 0x%02x", n, bad, size, st->resp[bad],
			     pattern_byte(&st->pat, n, bad) ^ RESPONSE_XOR);
		return TXN_ERROR;
	}
	return TXN_OK;
}

/* ---- tcp_rr: one connection, request/response ---------------------------------------- */

static int tcp_rr_open(struct worker *w)
{
	struct rr_state *st = rr_state_new(w, 0);
	struct sockaddr_storage a = addr_port(w->cfg, w->cfg->port);
	uint8_t hdr[PROTO_HDR_LEN];

	st->fd = tcp_connect(&a, w->cfg->addrlen);
	if (st->fd < 0) {
		report_unreachable(w->cfg, w->cfg->port, "tcp", errno);
		return -1;
	}
	proto_encode_header(hdr, PROTO_MODE_RR, w->cfg->size);
	if (write_all(st->fd, hdr, sizeof(hdr)) < 0) {
		report_unreachable(w->cfg, w->cfg->port, "tcp", errno);
		return -1;
	}
	return 0;
}

static enum txn_status tcp_rr_txn(struct worker *w, uint64_t *lat_ns)
{
	struct rr_state *st = w->priv;
	uint64_t n = w->next_txn++, t0;
	enum txn_status res;

	pattern_fill(&st->pat, n, st->req);
	t0 = now_ns();
	if (write_all(st->fd, st->req, w->cfg->size) < 0) {
		report_error(w, "transaction %" PRIu64 ": write: %s", n, io_error(errno));
		return TXN_FATAL;
	}
	res = read_tcp_response(w, st, n);
	*lat_ns = now_ns() - t0;
	return res;
}

const struct test_ops tcp_rr_test = {
	.name = "tcp_rr",
	.default_port = DEFAULT_PORT,
	.max_size = MAX_TCP_SIZE,
	.open = tcp_rr_open,
	.txn = tcp_rr_txn,
	.close = rr_close,
};

/* ---- udp_rr ----------------------------------------------------------------------------- */

static void remember_lost(struct rr_state *st, uint64_t n)
{
	size_t slots = sizeof(st->lost_ring) / sizeof(st->lost_ring[0]);

	st->lost_ring[st->lost_n++ % slots] = n;
}

/* Is this reply the (late) answer to a transaction that already timed out? */
static bool is_late_reply(const struct rr_state *st, const uint8_t *resp, size_t len)
{
	size_t slots = sizeof(st->lost_ring) / sizeof(st->lost_ring[0]);
	size_t k = st->lost_n < slots ? st->lost_n : slots, bad;

	if (len != st->pat.size)
		return false;
	for (size_t i = 0; i < k; i++)
		if (pattern_check(&st->pat, st->lost_ring[i], resp, &bad))
			return true;
	return false;
}

static enum txn_status udp_send(struct worker *w, struct rr_state *st, uint64_t n)
{
	ssize_t r;

	do
		r = send(st->fd, st->req, w->cfg->size, 0);
	while (r < 0 && errno == EINTR);
	if (r >= 0)
		return TXN_OK;
	if (errno == EAGAIN || errno == ENOBUFS) { /* dropped locally: like a loss */
		remember_lost(st, n);
		return TXN_LOST;
	}
	report_error(w, "transaction %" PRIu64 ": send: %s", n, strerror(errno));
	return TXN_FATAL;
}

static enum txn_status udp_rr_txn(struct worker *w, uint64_t *lat_ns)
{
	struct rr_state *st = w->priv;
	size_t size = w->cfg->size, bad = 0;
	uint64_t n = w->next_txn++, t0;
	enum txn_status res;

	pattern_fill(&st->pat, n, st->req);
	t0 = now_ns();
	res = udp_send(w, st, n);
	if (res != TXN_OK)
		return res;
	for (;;) {
		ssize_t r = recv(st->fd, st->resp, size + 1, 0);

		if (r < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN || errno == EWOULDBLOCK) {
				remember_lost(st, n);
				return TXN_LOST;
			}
			report_error(w, "transaction %" PRIu64 ": recv: %s", n, strerror(errno));
			return TXN_FATAL;
		}
		*lat_ns = now_ns() - t0;
		if ((size_t)r == size && pattern_check(&st->pat, n, st->resp, &bad))
			return TXN_OK;
		if (is_late_reply(st, st->resp, (size_t)r))
			continue; /* discard and keep waiting for ours */
		if ((size_t)r != size)
			report_error(w, "transaction %" PRIu64 ": reply of %zd bytes, expected %zu",
				     n, r, size);
		else
			report_error(w, "transaction %" PRIu64 ": reply byte %zu of %zu is 0x%02x, "
				     "expected 0x%02x, and it matches no earlier transaction",
				     n, bad, size, st->resp[bad],
				     pattern_byte(&st->pat, n, bad) ^ RESPONSE_XOR);
		return TXN_ERROR;
	}
}

/*
 * Opens the socket and proves the server answers: transactions (unrecorded)
 * until one succeeds, for up to 2 s.  Errors seen here still fail the run.
 */
static int udp_rr_open(struct worker *w)
{
	struct rr_state *st = rr_state_new(w, 0);
	struct sockaddr_storage a = addr_port(w->cfg, w->cfg->port);
	uint64_t deadline = now_ns() + 2000000000ull, lat;

	st->fd = socket(a.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (st->fd < 0 || set_timeouts(st->fd, UDP_TIMEOUT_MS, IO_TIMEOUT_MS) < 0 ||
	    connect(st->fd, (struct sockaddr *)&a, w->cfg->addrlen) < 0) {
		report_unreachable(w->cfg, w->cfg->port, "udp", errno);
		return -1;
	}
	while (now_ns() < deadline) {
		switch (udp_rr_txn(w, &lat)) {
		case TXN_OK:
			return 0;
		case TXN_LOST:
			break;
		case TXN_ERROR:
			w->pre_errors++;
			return 0;
		case TXN_FATAL: /* typically ECONNREFUSED: nothing listens */
			fprintf(stderr, "skiff-perf: udp_rr: cannot reach %s udp port %d\n",
				w->cfg->host, w->cfg->port);
			return -1;
		}
	}
	fprintf(stderr, "skiff-perf: udp_rr: no reply from %s udp port %d within 2 s\n",
		w->cfg->host, w->cfg->port);
	return -1;
}

const struct test_ops udp_rr_test = {
	.name = "udp_rr",
	.default_port = DEFAULT_PORT,
	.max_size = MAX_UDP_SIZE,
	.open = udp_rr_open,
	.txn = udp_rr_txn,
	.close = rr_close,
};

/* ---- tcp_crr: connect, request, response, server closes ------------------------------ */

/* One connection that sends nothing: the server just sees EOF. */
static int probe_tcp(struct worker *w, int port)
{
	struct sockaddr_storage a = addr_port(w->cfg, port);
	int fd = tcp_connect(&a, w->cfg->addrlen);

	if (fd < 0) {
		report_unreachable(w->cfg, port, "tcp", errno);
		return -1;
	}
	close(fd);
	return 0;
}

static int tcp_crr_open(struct worker *w)
{
	struct rr_state *st = rr_state_new(w, PROTO_HDR_LEN);

	proto_encode_header(st->req, PROTO_MODE_CRR, w->cfg->size);
	return probe_tcp(w, w->cfg->port);
}

/* After the response the server closes: anything but EOF is an error. */
static enum txn_status expect_eof(struct worker *w, int fd, uint64_t n)
{
	char c;
	ssize_t r;

	do
		r = read(fd, &c, 1);
	while (r < 0 && errno == EINTR);
	if (r == 0)
		return TXN_OK;
	if (r > 0)
		report_error(w, "transaction %" PRIu64 ": server sent more than the response", n);
	else
		report_error(w, "transaction %" PRIu64 ": waiting for the server to close: %s",
			     n, io_error(errno));
	return TXN_ERROR;
}

static enum txn_status tcp_crr_txn(struct worker *w, uint64_t *lat_ns)
{
	struct rr_state *st = w->priv;
	uint64_t n = w->next_txn++, t0;
	enum txn_status res;

	pattern_fill(&st->pat, n, st->req + PROTO_HDR_LEN);
	t0 = now_ns();
	st->fd = tcp_connect(&w->cfg->addr, w->cfg->addrlen);
	if (st->fd < 0) {
		report_error(w, "transaction %" PRIu64 ": connect: %s", n, strerror(errno));
		return TXN_FATAL;
	}
	/* Header and request in one write, as one segment. */
	if (write_all(st->fd, st->req, PROTO_HDR_LEN + w->cfg->size) < 0) {
		report_error(w, "transaction %" PRIu64 ": write: %s", n, io_error(errno));
		res = TXN_ERROR;
	} else {
		res = read_tcp_response(w, st, n);
		if (res == TXN_FATAL) /* this connection only: the next one may work */
			res = TXN_ERROR;
		else if (res == TXN_OK)
			res = expect_eof(w, st->fd, n);
	}
	close(st->fd);
	st->fd = -1;
	*lat_ns = now_ns() - t0;
	return res;
}

const struct test_ops tcp_crr_test = {
	.name = "tcp_crr",
	.default_port = DEFAULT_PORT,
	.max_size = MAX_TCP_SIZE,
	.open = tcp_crr_open,
	.txn = tcp_crr_txn,
	.close = rr_close,
};

/* ---- connect: latency of connect() until the server's first byte ---------------------- */

struct connect_state {
	struct sockaddr_storage addr; /* port P+1 */
};

static enum txn_status connect_txn(struct worker *w, uint64_t *lat_ns)
{
	struct connect_state *st = w->priv;
	uint64_t n = w->next_txn++, t0;
	enum txn_status res = TXN_OK;
	uint8_t b = 0;
	ssize_t r;
	int fd = tcp_socket(st->addr.ss_family);

	if (fd < 0) {
		report_error(w, "connection %" PRIu64 ": socket: %s", n, strerror(errno));
		return TXN_FATAL;
	}
	t0 = now_ns();
	if (connect_fd(fd, (struct sockaddr *)&st->addr, w->cfg->addrlen) < 0) {
		report_error(w, "connection %" PRIu64 ": connect: %s", n, strerror(errno));
		close(fd);
		return TXN_FATAL;
	}
	r = read_full(fd, &b, 1);
	*lat_ns = now_ns() - t0;
	if (r != 1) {
		report_error(w, "connection %" PRIu64 ": no byte from the server: %s", n,
			     r < 0 ? io_error(errno) : "EOF");
		res = TXN_ERROR;
	} else if (b != CONNECT_BYTE) {
		report_error(w, "connection %" PRIu64 ": server sent 0x%02x, expected 0x%02x", n,
			     b, CONNECT_BYTE);
		res = TXN_ERROR;
	}
	close(fd);
	return res;
}

static int connect_open(struct worker *w)
{
	struct connect_state *st = xcalloc(1, sizeof(*st));
	uint8_t b;
	int fd;

	w->priv = st;
	st->addr = addr_port(w->cfg, w->cfg->port + 1);
	/* Probe; read the byte so that our close does not reset the connection. */
	fd = tcp_connect(&st->addr, w->cfg->addrlen);
	if (fd < 0) {
		report_unreachable(w->cfg, w->cfg->port + 1, "tcp", errno);
		return -1;
	}
	if (read_full(fd, &b, 1) != 1) {
		fprintf(stderr, "skiff-perf: connect: %s port %d accepted but sent nothing\n",
			w->cfg->host, w->cfg->port + 1);
		close(fd);
		return -1;
	}
	close(fd);
	return 0;
}

static void connect_close(struct worker *w)
{
	free(w->priv);
	w->priv = NULL;
}

const struct test_ops connect_test = {
	.name = "connect",
	.default_port = DEFAULT_PORT,
	.max_size = 0,
	.open = connect_open,
	.txn = connect_txn,
	.close = connect_close,
};
