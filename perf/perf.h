/*
 * skiff-perf: request/response, connection and memcached load benchmarks.
 *
 * Shared declarations.  The program is split into:
 *   skiff-perf.c  command line parsing, main()
 *   util.c        time, socket and I/O helpers, latency samples, byte patterns
 *   server.c      the reflector server (tcp rr/crr, tcp connect, udp rr)
 *   client.c      the measuring engine: workers, phases, aggregation, JSON
 *   tests.c       tcp_rr, udp_rr, tcp_crr and connect tests
 *   memcached.c   the memcached text protocol load test
 */
#ifndef SKIFF_PERF_H
#define SKIFF_PERF_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>

/* Exit codes (the bench harness relies on them). */
#define EXIT_OK          0
#define EXIT_UNREACHABLE 1  /* server refused / unreachable / not answering */
#define EXIT_ERRORS      2  /* the run detected errors: result is invalid */
#define EXIT_USAGE       64 /* bad command line (sysexits EX_USAGE) */

#define DEFAULT_PORT           12865
#define MEMCACHED_DEFAULT_PORT 11211

/*
 * Wire protocol on TCP port P.  A connection starts with an 8 byte header so
 * the server knows the transaction size and whether it must close after the
 * first response (tcp_crr).  After it the stream is only payload: request of
 * SIZE bytes, response of SIZE bytes, each response byte = request byte ^ 0xA5.
 *   bytes 0-3  magic "SKF1"
 *   byte  4    mode (PROTO_MODE_RR or PROTO_MODE_CRR)
 *   bytes 5-7  size, 24 bit big endian
 * UDP port P has no header: every datagram is answered by its transform.
 * TCP port P+1 writes CONNECT_BYTE right after accept and waits for EOF.
 */
#define PROTO_HDR_LEN  8
#define PROTO_MAGIC    "SKF1"
#define PROTO_MODE_RR  1
#define PROTO_MODE_CRR 2
#define RESPONSE_XOR   0xA5
#define CONNECT_BYTE   0x53

#define MAX_TCP_SIZE (1u << 20) /* 1 MiB, must fit in 24 bits */
#define MAX_UDP_SIZE 65507u     /* largest IPv4 UDP payload */

/* Client side socket timeouts. */
#define IO_TIMEOUT_MS  10000 /* TCP connect/read/write: a stalled server is an error */
#define UDP_TIMEOUT_MS 50    /* a udp_rr reply later than this counts as lost */

#define MAX_CONNECTIONS 1000

/* ---- time ---------------------------------------------------------------- */

static inline uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- memory (allocation failure is fatal: exit EXIT_ERRORS) ---------------- */

void *xmalloc(size_t n);
void *xcalloc(size_t n, size_t size);
void *xrealloc(void *p, size_t n);

/* ---- latency samples --------------------------------------------------------- */

struct samples {
	uint64_t *v; /* nanoseconds */
	size_t n, cap;
};

void samples_grow(struct samples *s);

static inline void samples_push(struct samples *s, uint64_t ns)
{
	if (s->n == s->cap)
		samples_grow(s);
	s->v[s->n++] = ns;
}

struct latency_summary {
	double p50_us, p90_us, p99_us, p999_us, min_us, max_us, mean_us;
};

/* Sorts s in place and computes exact (nearest rank) percentiles. */
struct latency_summary samples_summarize(struct samples *s);

/* ---- I/O helpers (all retry on EINTR) ------------------------------------------ */

/* Reads until len bytes or EOF; returns bytes read (< len only on EOF), -1 on error. */
ssize_t read_full(int fd, void *buf, size_t len);
/* Writes all len bytes; 0 or -1 with errno. */
int write_all(int fd, const void *buf, size_t len);

int set_nodelay(int fd);
int set_timeouts(int fd, unsigned rcv_ms, unsigned snd_ms);
/* A TCP socket with TCP_NODELAY and IO_TIMEOUT_MS timeouts set, or -1. */
int tcp_socket(int family);
/* connect() that survives EINTR and reports a SO_SNDTIMEO timeout as ETIMEDOUT. */
int connect_fd(int fd, const struct sockaddr *sa, socklen_t len);
/* tcp_socket() + connect_fd(); -1 with errno on failure. */
int tcp_connect(const struct sockaddr_storage *ss, socklen_t len);

/* Resolves host (numeric or name); returns 0 or a getaddrinfo error code. */
int resolve_host(const char *host, bool passive, struct sockaddr_storage *ss, socklen_t *len);
void sockaddr_set_port(struct sockaddr_storage *ss, int port);

/* ---- request byte pattern ----------------------------------------------------- */

/*
 * Request byte i of transaction n: bytes 0-7 are n little endian (so a udp
 * reply identifies its transaction; with size 1 it is the low byte of n), the
 * rest is a per-position pseudo random byte XORed with a per-transaction byte.
 */
struct pattern {
	uint8_t *base;
	size_t size;
};

void pattern_init(struct pattern *p, size_t size);
void pattern_free(struct pattern *p);
void pattern_fill(const struct pattern *p, uint64_t n, uint8_t *out);
/* True if resp is the expected response to request n, else *bad = first wrong byte. */
bool pattern_check(const struct pattern *p, uint64_t n, const uint8_t *resp, size_t *bad);
uint8_t pattern_byte(const struct pattern *p, uint64_t n, size_t i);

void proto_encode_header(uint8_t hdr[PROTO_HDR_LEN], uint8_t mode, uint32_t size);

/* ---- client engine ------------------------------------------------------------- */

struct test_ops;

struct client_config {
	const char *host;
	int port;
	const struct test_ops *test;
	double duration_s; /* 0: no time limit (only --count) */
	uint64_t count;    /* 0: no count limit */
	double warmup_s;
	uint32_t size;
	unsigned connections;
	bool new_conn;
	struct sockaddr_storage addr; /* host with port already set */
	socklen_t addrlen;
};

struct counters {
	uint64_t ok, errors, lost;
	uint64_t gets, sets, hits, misses; /* memcached only */
};

struct run_shared;

struct worker {
	const struct client_config *cfg;
	struct run_shared *shared;
	unsigned id;
	uint64_t next_txn;    /* number n of the next transaction */
	void *priv;           /* test state, owned by the test ops */
	struct counters cnt;  /* of the current phase */
	uint64_t pre_errors;  /* errors before the measured phase (probe, warmup) */
	struct samples lat;   /* measured phase only */
	bool dead;            /* a fatal error ended this worker */
	uint64_t t_start, t_end;
};

enum txn_status {
	TXN_OK,    /* verified; *lat_ns is valid */
	TXN_LOST,  /* udp: no reply in time (not an error) */
	TXN_ERROR, /* counted as error; the worker continues */
	TXN_FATAL, /* counted as error; the worker cannot continue */
};

struct test_ops {
	const char *name;
	int default_port;
	uint32_t max_size;   /* 0: --size does not apply */
	bool multi_conn;     /* --connections and --new-conn apply */
	/* Optional, once before the workers open: 0 ok, -1 unreachable (message
	 * printed); *errors counts verification errors. */
	int (*setup)(const struct client_config *cfg, uint64_t *errors);
	/* 0 ok, -1 server unreachable (message printed). */
	int (*open)(struct worker *w);
	enum txn_status (*txn)(struct worker *w, uint64_t *lat_ns);
	void (*close)(struct worker *w);
};

extern const struct test_ops tcp_rr_test, udp_rr_test, tcp_crr_test, connect_test,
	memcached_test;

int run_client(const struct client_config *cfg);

/* Prints "skiff-perf: TEST: message" on stderr; only the first few per run. */
void report_error(const struct worker *w, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));
/* Message about a worker that failed to reach the server. */
void report_unreachable(const struct client_config *cfg, int port, const char *what, int err);

/* ---- server ---------------------------------------------------------------------- */

struct server_config {
	const char *bind;
	int port;
	uint64_t corrupt_every; /* test only: 0 = never */
};

int run_server(const struct server_config *cfg);

#endif
