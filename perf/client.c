/*
 * The measuring engine.
 *
 * Each worker (one for the single connection tests, --connections for
 * memcached) runs in its own thread:  barrier, optional warmup phase (not
 * recorded), barrier, measured phase.  A phase ends at its deadline or when
 * the shared --count tickets are used up.  The measured duration is from the
 * earliest worker start to the latest worker end, so the rate is honest for
 * both time and count limited runs.
 */
#include "perf.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define MAX_ERROR_MESSAGES 20

struct run_shared {
	pthread_barrier_t barrier;
	atomic_uint_fast64_t tickets; /* transactions started in the measured phase */
};

/* The only global state: limits error messages on stderr for the whole run. */
static atomic_uint error_messages;

void report_error(const struct worker *w, const char *fmt, ...)
{
	unsigned k = atomic_fetch_add(&error_messages, 1);
	char msg[512];
	va_list ap;

	if (k > MAX_ERROR_MESSAGES)
		return;
	if (k == MAX_ERROR_MESSAGES) {
		fprintf(stderr, "skiff-perf: %s: further error messages suppressed\n",
			w->cfg->test->name);
		return;
	}
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (w->cfg->connections > 1)
		fprintf(stderr, "skiff-perf: %s: connection %u: %s\n", w->cfg->test->name,
			w->id, msg);
	else
		fprintf(stderr, "skiff-perf: %s: %s\n", w->cfg->test->name, msg);
}

void report_unreachable(const struct client_config *cfg, int port, const char *what, int err)
{
	fprintf(stderr, "skiff-perf: %s: cannot reach %s port %d (%s): %s\n", cfg->test->name,
		cfg->host, port, what, strerror(err));
}

/* ---- phases --------------------------------------------------------------------- */

static void run_phase(struct worker *w, double secs, uint64_t count, bool record)
{
	const struct test_ops *t = w->cfg->test;
	uint64_t deadline = UINT64_MAX;

	w->t_start = now_ns();
	if (secs > 0)
		deadline = w->t_start + (uint64_t)(secs * 1e9);
	while (!w->dead && now_ns() < deadline) {
		uint64_t lat = 0;

		if (count && atomic_fetch_add_explicit(&w->shared->tickets, 1,
						       memory_order_relaxed) >= count)
			break;
		switch (t->txn(w, &lat)) {
		case TXN_OK:
			w->cnt.ok++;
			if (record)
				samples_push(&w->lat, lat);
			break;
		case TXN_LOST:
			w->cnt.lost++;
			break;
		case TXN_ERROR:
			w->cnt.errors++;
			break;
		case TXN_FATAL:
			w->cnt.errors++;
			w->dead = true;
			break;
		}
	}
	w->t_end = now_ns();
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	const struct client_config *cfg = w->cfg;

	pthread_barrier_wait(&w->shared->barrier);
	if (cfg->warmup_s > 0) {
		run_phase(w, cfg->warmup_s, 0, false);
		w->pre_errors += w->cnt.errors;
		memset(&w->cnt, 0, sizeof(w->cnt));
		pthread_barrier_wait(&w->shared->barrier);
	}
	run_phase(w, cfg->duration_s, cfg->count, true);
	return NULL;
}

/* ---- results ---------------------------------------------------------------------- */

struct result {
	struct counters cnt;
	uint64_t errors; /* all phases */
	double duration_s;
	struct samples lat;
};

static void aggregate(struct worker *ws, unsigned n, struct result *r)
{
	uint64_t start = UINT64_MAX, end = 0;
	size_t total = 0;

	for (unsigned i = 0; i < n; i++)
		total += ws[i].lat.n;
	r->lat.v = xmalloc(total * sizeof(uint64_t));
	r->lat.cap = total;
	for (unsigned i = 0; i < n; i++) {
		struct worker *w = &ws[i];

		r->cnt.ok += w->cnt.ok;
		r->cnt.lost += w->cnt.lost;
		r->cnt.gets += w->cnt.gets;
		r->cnt.sets += w->cnt.sets;
		r->cnt.hits += w->cnt.hits;
		r->cnt.misses += w->cnt.misses;
		r->errors += w->cnt.errors + w->pre_errors;
		if (w->t_start < start)
			start = w->t_start;
		if (w->t_end > end)
			end = w->t_end;
		if (w->lat.n)
			memcpy(r->lat.v + r->lat.n, w->lat.v, w->lat.n * sizeof(uint64_t));
		r->lat.n += w->lat.n;
	}
	r->duration_s = end > start ? (double)(end - start) / 1e9 : 0;
}

static void print_json(const struct client_config *cfg, struct result *r)
{
	struct latency_summary l = samples_summarize(&r->lat);
	double rate = r->duration_s > 0 ? (double)r->cnt.ok / r->duration_s : 0;

	printf("{\"test\":\"%s\",\"transactions\":%" PRIu64 ",\"errors\":%" PRIu64
	       ",\"lost\":%" PRIu64 ",\"duration_s\":%.6f,\"rate\":%.1f,\"p50_us\":%.3f"
	       ",\"p90_us\":%.3f,\"p99_us\":%.3f,\"p999_us\":%.3f,\"min_us\":%.3f"
	       ",\"max_us\":%.3f,\"mean_us\":%.3f",
	       cfg->test->name, r->cnt.ok, r->errors, r->cnt.lost, r->duration_s, rate,
	       l.p50_us, l.p90_us, l.p99_us, l.p999_us, l.min_us, l.max_us, l.mean_us);
	if (cfg->test == &memcached_test)
		printf(",\"gets\":%" PRIu64 ",\"sets\":%" PRIu64 ",\"hits\":%" PRIu64
		       ",\"misses\":%" PRIu64, r->cnt.gets, r->cnt.sets, r->cnt.hits,
		       r->cnt.misses);
	printf("}\n");
	fflush(stdout);
}

/* Prints the result and returns the exit code. */
static int finish(const struct client_config *cfg, struct result *r)
{
	print_json(cfg, r);
	if (r->errors > 0) {
		fprintf(stderr, "skiff-perf: %s: %" PRIu64 " error(s) detected; this result "
			"is NOT valid\n", cfg->test->name, r->errors);
		return EXIT_ERRORS;
	}
	if (r->cnt.ok == 0) {
		fprintf(stderr, "skiff-perf: %s: no transaction completed\n", cfg->test->name);
		return EXIT_ERRORS;
	}
	return EXIT_OK;
}

/* ---- run ----------------------------------------------------------------------------- */

static void close_workers(struct worker *ws, unsigned n)
{
	for (unsigned i = 0; i < n; i++) {
		if (ws[i].priv)
			ws[i].cfg->test->close(&ws[i]);
		free(ws[i].lat.v);
	}
}

static void start_workers(struct worker *ws, unsigned n, pthread_t *tids)
{
	pthread_attr_t attr;

	pthread_attr_init(&attr);
	pthread_attr_setstacksize(&attr, 256 * 1024);
	for (unsigned i = 0; i < n; i++) {
		int rc = pthread_create(&tids[i], &attr, worker_main, &ws[i]);

		if (rc != 0) {
			/* Started workers wait on the barrier forever: just leave. */
			fprintf(stderr, "skiff-perf: cannot create worker thread: %s\n",
				strerror(rc));
			exit(EXIT_ERRORS);
		}
	}
	pthread_attr_destroy(&attr);
}

int run_client(const struct client_config *cfg)
{
	const struct test_ops *t = cfg->test;
	unsigned n = t->multi_conn ? cfg->connections : 1;
	struct result r = { 0 };
	struct run_shared shared;
	struct worker *ws;
	pthread_t *tids;
	int rc;

	signal(SIGPIPE, SIG_IGN);
	if (t->setup && t->setup(cfg, &r.errors) < 0)
		return EXIT_UNREACHABLE;
	if (r.errors > 0) /* e.g. memcached refused to store the keyspace */
		return finish(cfg, &r);

	ws = xcalloc(n, sizeof(*ws));
	tids = xcalloc(n, sizeof(*tids));
	atomic_init(&shared.tickets, 0);
	for (unsigned i = 0; i < n; i++) {
		ws[i].cfg = cfg;
		ws[i].shared = &shared;
		ws[i].id = i;
		if (t->open(&ws[i]) < 0) {
			close_workers(ws, i + 1);
			free(ws);
			free(tids);
			return EXIT_UNREACHABLE;
		}
	}
	pthread_barrier_init(&shared.barrier, NULL, n);
	start_workers(ws, n, tids);
	for (unsigned i = 0; i < n; i++)
		pthread_join(tids[i], NULL);
	pthread_barrier_destroy(&shared.barrier);

	aggregate(ws, n, &r);
	close_workers(ws, n);
	rc = finish(cfg, &r);
	free(r.lat.v);
	free(ws);
	free(tids);
	return rc;
}
