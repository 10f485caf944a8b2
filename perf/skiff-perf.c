/*
 * skiff-perf: netperf-like request/response, connection and memcached load
 * benchmarks for the skiff overlay network.  See README.md.
 *
 * This file: command line parsing and dispatch.
 */
#include "perf.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static const char usage_text[] =
	"usage:\n"
	"  skiff-perf server [--bind ADDR] [--port P]\n"
	"  skiff-perf client --host IP [--port P] --test NAME [--duration SECONDS | --count N]\n"
	"                    [--size BYTES] [--connections C] [--new-conn] [--warmup SECONDS]\n"
	"  skiff-perf --help\n"
	"\n"
	"server: answers on tcp/P (tcp_rr, tcp_crr), tcp/P+1 (connect) and udp/P (udp_rr)\n"
	"        until SIGTERM or SIGINT.\n"
	"  --bind ADDR          listen address (default 0.0.0.0)\n"
	"  --port P             base port (default 12865)\n"
	"  --corrupt-every N    TEST ONLY: corrupt one byte of every N-th response, so\n"
	"                       tests can prove that clients detect it\n"
	"\n"
	"client:\n"
	"  --host IP            server address\n"
	"  --port P             server base port (default 12865; memcached: 11211)\n"
	"  --test NAME          tcp_rr | udp_rr | tcp_crr | connect | memcached\n"
	"  --duration SECONDS   measured time (default 5 unless --count is given)\n"
	"  --count N            transactions to run; with --duration, whichever ends first\n"
	"  --size BYTES         request and response size, tcp_rr/udp_rr/tcp_crr (default 1)\n"
	"  --connections C      memcached only: concurrent connections (default 50)\n"
	"  --new-conn           memcached only: a new TCP connection for every request\n"
	"  --warmup SECONDS     run that long first without recording (default 0)\n"
	"\n"
	"Prints one JSON line on stdout.  Exit status: 0 ok, 1 server unreachable,\n"
	"2 errors detected (the JSON line is printed, but the result is not valid),\n"
	"64 bad usage.\n";

__attribute__((format(printf, 1, 2)))
static int usage_error(const char *fmt, ...)
{
	va_list ap;

	fputs("skiff-perf: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputs("\n\n", stderr);
	fputs(usage_text, stderr);
	return EXIT_USAGE;
}

/* ---- number parsing (strict: whole string, no sign, in range) ------------------------- */

static bool parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *out)
{
	char *end;
	unsigned long long v;

	if (*s < '0' || *s > '9')
		return false;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || *end || v < min || v > max)
		return false;
	*out = v;
	return true;
}

static bool parse_seconds(const char *s, bool allow_zero, double *out)
{
	char *end;
	double v;

	if (!((*s >= '0' && *s <= '9') || *s == '.'))
		return false;
	errno = 0;
	v = strtod(s, &end);
	if (errno || *end || !isfinite(v) || v > 1e6 || (allow_zero ? v < 0 : v <= 0))
		return false;
	*out = v;
	return true;
}

/* ---- server ------------------------------------------------------------------------------ */

static int server_main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "bind", required_argument, NULL, 'b' },
		{ "port", required_argument, NULL, 'p' },
		{ "corrupt-every", required_argument, NULL, 'C' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	struct server_config cfg = { .bind = "0.0.0.0", .port = DEFAULT_PORT };
	uint64_t v;
	int c;

	while ((c = getopt_long(argc, argv, ":", opts, NULL)) != -1) {
		switch (c) {
		case 'b':
			cfg.bind = optarg;
			break;
		case 'p':
			if (!parse_u64(optarg, 1, 65534, &v))
				return usage_error("bad --port %s (1..65534, P+1 is used too)", optarg);
			cfg.port = (int)v;
			break;
		case 'C':
			if (!parse_u64(optarg, 1, UINT32_MAX, &v))
				return usage_error("bad --corrupt-every %s", optarg);
			cfg.corrupt_every = v;
			break;
		case 'h':
			fputs(usage_text, stdout);
			return EXIT_OK;
		case ':':
			return usage_error("option %s needs a value", argv[optind - 1]);
		default:
			return usage_error("unknown server option %s", argv[optind - 1]);
		}
	}
	if (optind < argc)
		return usage_error("unexpected argument %s", argv[optind]);
	return run_server(&cfg);
}

/* ---- client ------------------------------------------------------------------------------ */

static const struct test_ops *find_test(const char *name)
{
	static const struct test_ops *const tests[] = {
		&tcp_rr_test, &udp_rr_test, &tcp_crr_test, &connect_test, &memcached_test,
	};

	for (size_t i = 0; i < sizeof(tests) / sizeof(tests[0]); i++)
		if (strcmp(tests[i]->name, name) == 0)
			return tests[i];
	return NULL;
}

/* Which options the user actually gave (their defaults depend on the test). */
struct given {
	bool port, duration, size, connections;
};

static int parse_client_opts(int argc, char **argv, struct client_config *cfg,
			     struct given *given)
{
	static const struct option opts[] = {
		{ "host", required_argument, NULL, 'H' },
		{ "port", required_argument, NULL, 'p' },
		{ "test", required_argument, NULL, 't' },
		{ "duration", required_argument, NULL, 'd' },
		{ "count", required_argument, NULL, 'n' },
		{ "size", required_argument, NULL, 's' },
		{ "connections", required_argument, NULL, 'c' },
		{ "new-conn", no_argument, NULL, 'N' },
		{ "warmup", required_argument, NULL, 'w' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	uint64_t v;
	int c;

	while ((c = getopt_long(argc, argv, ":", opts, NULL)) != -1) {
		switch (c) {
		case 'H':
			cfg->host = optarg;
			break;
		case 'p':
			if (!parse_u64(optarg, 1, 65535, &v))
				return usage_error("bad --port %s", optarg);
			cfg->port = (int)v;
			given->port = true;
			break;
		case 't':
			cfg->test = find_test(optarg);
			if (!cfg->test)
				return usage_error("unknown --test %s (tcp_rr, udp_rr, tcp_crr, "
						   "connect, memcached)", optarg);
			break;
		case 'd':
			if (!parse_seconds(optarg, false, &cfg->duration_s))
				return usage_error("bad --duration %s (seconds > 0)", optarg);
			given->duration = true;
			break;
		case 'n':
			if (!parse_u64(optarg, 1, UINT64_MAX / 2, &cfg->count))
				return usage_error("bad --count %s (>= 1)", optarg);
			break;
		case 's':
			if (!parse_u64(optarg, 1, MAX_TCP_SIZE, &v))
				return usage_error("bad --size %s (1..1048576)", optarg);
			cfg->size = (uint32_t)v;
			given->size = true;
			break;
		case 'c':
			if (!parse_u64(optarg, 1, MAX_CONNECTIONS, &v))
				return usage_error("bad --connections %s (1..1000)", optarg);
			cfg->connections = (unsigned)v;
			given->connections = true;
			break;
		case 'N':
			cfg->new_conn = true;
			break;
		case 'w':
			if (!parse_seconds(optarg, true, &cfg->warmup_s))
				return usage_error("bad --warmup %s (seconds >= 0)", optarg);
			break;
		case 'h':
			fputs(usage_text, stdout);
			return -1;
		case ':':
			return usage_error("option %s needs a value", argv[optind - 1]);
		default:
			return usage_error("unknown client option %s", argv[optind - 1]);
		}
	}
	if (optind < argc)
		return usage_error("unexpected argument %s", argv[optind]);
	return 0;
}

/* Checks combinations and fills in the test dependent defaults. */
static int finish_client_config(struct client_config *cfg, const struct given *given)
{
	const struct test_ops *t = cfg->test;

	if (!cfg->host)
		return usage_error("--host is required");
	if (!t)
		return usage_error("--test is required");
	if (!given->port)
		cfg->port = t->default_port;
	if (t == &connect_test && cfg->port > 65534)
		return usage_error("--port must be <= 65534 for connect (uses P+1)");
	if (given->size && t->max_size == 0)
		return usage_error("--size does not apply to --test %s", t->name);
	if (cfg->size > t->max_size && t->max_size > 0)
		return usage_error("--size too large for --test %s", t->name);
	if ((given->connections || cfg->new_conn) && !t->multi_conn)
		return usage_error("--connections/--new-conn do not apply to --test %s", t->name);
	if (!given->connections)
		cfg->connections = t->multi_conn ? 50 : 1;
	if (!given->duration && cfg->count == 0)
		cfg->duration_s = 5.0;
	return 0;
}

static int client_main(int argc, char **argv)
{
	struct client_config cfg = { .size = 1 };
	struct given given = { 0 };
	int rc = parse_client_opts(argc, argv, &cfg, &given);

	if (rc != 0)
		return rc < 0 ? EXIT_OK : rc;
	rc = finish_client_config(&cfg, &given);
	if (rc != 0)
		return rc;
	rc = resolve_host(cfg.host, false, &cfg.addr, &cfg.addrlen);
	if (rc != 0) {
		fprintf(stderr, "skiff-perf: cannot resolve --host %s: %s\n", cfg.host,
			gai_strerror(rc));
		return EXIT_UNREACHABLE;
	}
	sockaddr_set_port(&cfg.addr, cfg.port);
	return run_client(&cfg);
}

int main(int argc, char **argv)
{
	if (argc < 2)
		return usage_error("missing command (server or client)");
	if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
	    strcmp(argv[1], "help") == 0) {
		fputs(usage_text, stdout);
		return EXIT_OK;
	}
	if (strcmp(argv[1], "server") == 0)
		return server_main(argc - 1, argv + 1);
	if (strcmp(argv[1], "client") == 0)
		return client_main(argc - 1, argv + 1);
	return usage_error("unknown command %s (server or client)", argv[1]);
}
