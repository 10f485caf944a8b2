/* libslim.so: the preloaded half of the papers' designs that package slim
 * reproduces for skiff bench (docs/design/slim.md).
 *
 * SLIM_DESIGN=slim (Slim, NSDI '19, §4.1): every TCP socket the
 * application makes gets a twin in the host's namespace from the router
 * (SCM_RIGHTS). A listener's twin is bound to the host address; at accept
 * the server sends the twin's address to the client over the overlay
 * connection, then has the router accept the host connection, which is
 * what the application gets. A client connects over the overlay first,
 * reads that address, has the router connect its twin there, and puts the
 * twin in place of its socket (dup3); the overlay connection stays behind
 * for the names.
 *
 * SLIM_DESIGN=slimfast (SlimFast, TCC '23, §III-B): listen registers the
 * overlay address with the router over a Unix connection that replaces
 * the listening socket; accept receives host connections on it. connect
 * asks the router for a host connection to the destination's host (the
 * router writes SlimFast's header) and puts it in place of the socket.
 * No overlay packet at all.
 *
 * Other settings: SLIM_ROUTER_DIR (the host's routers' sockets,
 * <design>.sock), SLIM_CIDR (the overlay's range: only its addresses are
 * taken), SLIM_STRICT=1 (a router that does not answer fails the call, so
 * that overlay figures never pass for the design's). TCP over IPv4 here,
 * SlimFast's UDP in udp.c; TCP's data calls (read, write, poll) are the
 * kernel's, untouched. */
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "slim.h"

enum design design;
bool strict;
pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char router[sizeof(((struct sockaddr_un *)0)->sun_path)];
static uint32_t cidr_net, cidr_mask;
static struct ent *tab;

int (*real_socket)(int, int, int);
int (*real_bind)(int, const struct sockaddr *, socklen_t);
static int (*real_listen)(int, int);
static int (*real_accept4)(int, struct sockaddr *, socklen_t *, int);
int (*real_connect)(int, const struct sockaddr *, socklen_t);
int (*real_close)(int);
static int (*real_setsockopt)(int, int, int, const void *, socklen_t);
int (*real_getsockname)(int, struct sockaddr *, socklen_t *);
static int (*real_getpeername)(int, struct sockaddr *, socklen_t *);
static int (*real_epoll_ctl)(int, int, int, struct epoll_event *);

static void *must(const char *name)
{
	void *f = dlsym(RTLD_NEXT, name);
	if (!f) {
		fprintf(stderr, "libslim: no %s\n", name);
		abort();
	}
	return f;
}

__attribute__((constructor)) static void init(void)
{
	real_socket = must("socket");
	real_bind = must("bind");
	real_listen = must("listen");
	real_accept4 = must("accept4");
	real_connect = must("connect");
	real_close = must("close");
	real_setsockopt = must("setsockopt");
	real_getsockname = must("getsockname");
	real_getpeername = must("getpeername");
	real_epoll_ctl = must("epoll_ctl");
	const char *d = getenv("SLIM_DESIGN"), *dir = getenv("SLIM_ROUTER_DIR"), *cidr = getenv("SLIM_CIDR");
	if (!d || !dir || !cidr)
		return;
	if (!strcmp(d, "slim"))
		design = SLIM;
	else if (!strcmp(d, "slimfast"))
		design = SLIMFAST;
	else
		return;
	char net[32];
	unsigned bits;
	struct in_addr a;
	if (sscanf(cidr, "%31[0-9.]/%u", net, &bits) != 2 || bits > 32 || inet_pton(AF_INET, net, &a) != 1 ||
	    snprintf(router, sizeof(router), "%s/%s.sock", dir, d) >= (int)sizeof(router)) {
		fprintf(stderr, "libslim: SLIM_CIDR %s or SLIM_ROUTER_DIR %s unusable: off\n", cidr, dir);
		design = NONE;
		return;
	}
	cidr_mask = bits ? htonl(~0u << (32 - bits)) : 0;
	cidr_net = a.s_addr & cidr_mask;
	strict = getenv("SLIM_STRICT") && !strcmp(getenv("SLIM_STRICT"), "1");
	tab = calloc(MAXFD, sizeof(*tab));
	if (!tab)
		design = NONE;
}

struct ent *ent(int fd)
{
	return (design && fd >= 0 && fd < MAXFD) ? &tab[fd] : NULL;
}

bool in_cidr(const struct sockaddr *sa, socklen_t len)
{
	const struct sockaddr_in *in = (const void *)sa;
	return sa && len >= sizeof(*in) && in->sin_family == AF_INET && (in->sin_addr.s_addr & cidr_mask) == cidr_net;
}

/* ask sends req (with fd_in, if >= 0) to the router and reads its reply
 * (and the fd it carries into *fd_out). keep: the connection is returned
 * open in *conn instead of closed. */
int ask(const struct slim_req *req, size_t len, int fd_in, struct slim_rsp *rsp, int *fd_out, int *conn)
{
	int u = real_socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (u < 0)
		return -1;
	struct sockaddr_un sun = {.sun_family = AF_UNIX};
	memcpy(sun.sun_path, router, sizeof(router));
	if (real_connect(u, (struct sockaddr *)&sun, sizeof(sun)) < 0)
		goto fail;
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(sizeof(int))];
	} c;
	struct iovec iov = {.iov_base = (void *)req, .iov_len = len};
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
	if (fd_in >= 0) {
		memset(&c, 0, sizeof(c));
		m.msg_control = c.b;
		m.msg_controllen = sizeof(c.b);
		struct cmsghdr *h = CMSG_FIRSTHDR(&m);
		h->cmsg_level = SOL_SOCKET;
		h->cmsg_type = SCM_RIGHTS;
		h->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(h), &fd_in, sizeof(int));
	}
	if (sendmsg(u, &m, MSG_NOSIGNAL) < 0)
		goto fail;
	memset(&c, 0, sizeof(c));
	iov = (struct iovec){.iov_base = rsp, .iov_len = sizeof(*rsp)};
	m = (struct msghdr){.msg_iov = &iov, .msg_iovlen = 1, .msg_control = c.b, .msg_controllen = sizeof(c.b)};
	struct pollfd p = {.fd = u, .events = POLLIN};
	if (poll(&p, 1, 2 * WAIT_MS) != 1)
		goto fail;
	ssize_t n = recvmsg(u, &m, MSG_CMSG_CLOEXEC);
	if (n != (ssize_t)sizeof(*rsp))
		goto fail;
	if (fd_out) {
		*fd_out = -1;
		struct cmsghdr *h = CMSG_FIRSTHDR(&m);
		if (h && h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_RIGHTS)
			memcpy(fd_out, CMSG_DATA(h), sizeof(int));
	}
	if (conn)
		*conn = u;
	else
		real_close(u);
	return 0;
fail:
	real_close(u);
	return -1;
}

struct slim_req req(uint16_t op)
{
	return (struct slim_req){.magic = SLIM_MAGIC, .op = op};
}

/* refused ends a call the router did not serve: an error (SLIM_STRICT),
 * or the plain call. */
int refused(int err)
{
	errno = err;
	return -1;
}

/* own_addrs lists this namespace's addresses in the overlay's range. */
int own_addrs(uint32_t *out, int max)
{
	struct ifaddrs *ifs, *i;
	int n = 0;
	if (getifaddrs(&ifs) < 0)
		return 0;
	for (i = ifs; i && n < max; i = i->ifa_next)
		if (i->ifa_addr && in_cidr(i->ifa_addr, sizeof(struct sockaddr_in)))
			out[n++] = ((struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr;
	freeifaddrs(ifs);
	return n;
}

/* swap puts host socket h in place of fd (keeping fd's close-on-exec and
 * epoll registrations) and returns a duplicate of fd's old socket (-1:
 * closed, keep false). */
int swap(int fd, int h, bool keep)
{
	struct ent *e = ent(fd);
	int old = keep ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
	int fdfl = fcntl(fd, F_GETFD);
	for (int i = 0; i < e->nep; i++)
		real_epoll_ctl(e->ep[i].epfd, EPOLL_CTL_DEL, fd, NULL);
	if (dup3(h, fd, (fdfl >= 0 && (fdfl & FD_CLOEXEC)) ? O_CLOEXEC : 0) < 0) {
		if (old >= 0)
			real_close(old);
		return -2;
	}
	real_close(h);
	for (int i = 0; i < e->nep; i++)
		real_epoll_ctl(e->ep[i].epfd, EPOLL_CTL_ADD, fd, &e->ep[i].ev);
	return old;
}

void set_nonblock(int fd, bool on)
{
	int fl = fcntl(fd, F_GETFL);
	if (fl >= 0)
		fcntl(fd, F_SETFL, on ? fl | O_NONBLOCK : fl & ~O_NONBLOCK);
}

bool nonblocking(int fd)
{
	int fl = fcntl(fd, F_GETFL);
	return fl >= 0 && (fl & O_NONBLOCK);
}

/* replay_opts sets the options the application set on its socket again on h. */
void replay_opts(struct ent *e, int h)
{
	for (int i = 0; i < e->nopt; i++)
		real_setsockopt(h, e->opt[i].level, e->opt[i].name, e->opt[i].v, e->opt[i].len);
}

EXPORT int socket(int domain, int type, int protocol)
{
	int fd = real_socket(domain, type, protocol);
	struct ent *e = ent(fd);
	if (e && domain == AF_INET && (type & 0xf) == SOCK_DGRAM && design == SLIMFAST) {
		pthread_mutex_lock(&mu);
		udp_forget(e);
		memset(e, 0, sizeof(*e));
		e->kind = K_UFRESH;
		e->hfd = e->ofd = -1;
		pthread_mutex_unlock(&mu);
		return fd;
	}
	if (!e || domain != AF_INET || (type & 0xf) != SOCK_STREAM)
		return fd;
	pthread_mutex_lock(&mu);
	memset(e, 0, sizeof(*e));
	e->kind = K_FRESH;
	e->hfd = e->ofd = -1;
	pthread_mutex_unlock(&mu);
	if (design == SLIM) {
		/* §4.1: socket() goes to the router, which makes the twin. */
		struct slim_req r = req(OP_SOCKET);
		struct slim_rsp rsp;
		int h = -1;
		if (ask(&r, sizeof(r), -1, &rsp, &h, NULL) < 0 || rsp.err || h < 0) {
			e->kind = K_NONE;
			if (strict) {
				real_close(fd);
				return refused(EHOSTUNREACH);
			}
			return fd;
		}
		e->hfd = h;
	}
	return fd;
}

EXPORT int setsockopt(int fd, int level, int name, const void *v, socklen_t len)
{
	int rc = real_setsockopt(fd, level, name, v, len);
	struct ent *e = ent(fd);
	if (rc < 0 || !e || (e->kind != K_FRESH && e->kind != K_UFRESH))
		return rc;
	if (e->hfd >= 0) /* Slim: the twin gets the same options */
		real_setsockopt(e->hfd, level, name, v, len);
	else if (design == SLIMFAST && len <= sizeof(e->opt[0].v) && e->nopt < MAXOPT) {
		struct opt *o = &e->opt[e->nopt++];
		o->level = level, o->name = name, o->len = len;
		memcpy(o->v, v, len);
	}
	return rc;
}

EXPORT int epoll_ctl(int epfd, int op, int fd, struct epoll_event *ev)
{
	int rc = real_epoll_ctl(epfd, op, fd, ev);
	struct ent *e = ent(fd);
	if (rc < 0 || !e || e->kind != K_FRESH)
		return rc;
	pthread_mutex_lock(&mu);
	int i = 0;
	while (i < e->nep && e->ep[i].epfd != epfd)
		i++;
	if (op == EPOLL_CTL_DEL && i < e->nep)
		e->ep[i] = e->ep[--e->nep];
	else if (op != EPOLL_CTL_DEL && ev && (i < e->nep || e->nep < MAXEP)) {
		if (i == e->nep)
			e->nep++;
		e->ep[i].epfd = epfd;
		e->ep[i].ev = *ev;
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

/* slim_bind binds a Slim twin to the host address (the router's port translation). */
static int slim_bind(struct ent *e)
{
	struct slim_req r = req(OP_BIND);
	struct slim_rsp rsp;
	if (ask(&r, sizeof(r), e->hfd, &rsp, NULL, NULL) < 0 || rsp.err)
		return -1;
	e->bound = (struct sockaddr_in){.sin_family = AF_INET, .sin_addr.s_addr = rsp.ip, .sin_port = htons(rsp.port)};
	return 0;
}

EXPORT int bind(int fd, const struct sockaddr *sa, socklen_t len)
{
	int rc = real_bind(fd, sa, len);
	struct ent *e = ent(fd);
	if (rc == 0 && e && e->kind == K_UFRESH)
		return udp_bind(fd, e, sa, len);
	if (rc < 0 || !e || e->kind != K_FRESH || e->hfd < 0)
		return rc;
	const struct sockaddr_in *in = (const void *)sa;
	if ((in_cidr(sa, len) || (len >= sizeof(*in) && in->sin_addr.s_addr == INADDR_ANY)) && slim_bind(e) < 0 && strict)
		return refused(EHOSTUNREACH);
	return rc;
}

EXPORT int listen(int fd, int backlog)
{
	struct ent *e = ent(fd);
	if (!e || e->kind != K_FRESH)
		return real_listen(fd, backlog);
	if (design == SLIM) {
		int rc = real_listen(fd, backlog);
		if (rc < 0 || e->hfd < 0)
			return rc;
		if ((!e->bound.sin_port && slim_bind(e) < 0) || real_listen(e->hfd, backlog) < 0)
			return strict ? refused(EHOSTUNREACH) : rc;
		e->kind = K_LISTEN;
		return rc;
	}
	/* SlimFast: the overlay address goes in the router's table, and the
	 * registration's connection becomes the listening socket. */
	struct sockaddr_in me;
	socklen_t ml = sizeof(me);
	if (real_getsockname(fd, (struct sockaddr *)&me, &ml) < 0 || me.sin_family != AF_INET)
		return real_listen(fd, backlog);
	if (!me.sin_port) {
		struct sockaddr_in any = {.sin_family = AF_INET};
		if (real_bind(fd, (struct sockaddr *)&any, sizeof(any)) < 0 || real_getsockname(fd, (struct sockaddr *)&me, &ml) < 0)
			return -1;
	}
	struct {
		struct slim_req r;
		uint32_t extra[4];
	} m = {.r = req(OP_REGISTER)};
	uint32_t addrs[5];
	int n = 0;
	if (me.sin_addr.s_addr == INADDR_ANY)
		n = own_addrs(addrs, 5);
	else if (in_cidr((struct sockaddr *)&me, sizeof(me)))
		addrs[n++] = me.sin_addr.s_addr;
	if (n == 0)
		return real_listen(fd, backlog);
	m.r.ip = addrs[0];
	m.r.port = ntohs(me.sin_port);
	m.r.count = n - 1;
	memcpy(m.extra, addrs + 1, (n - 1) * sizeof(uint32_t));
	struct slim_rsp rsp;
	int u = -1;
	if (ask(&m.r, sizeof(m.r) + (n - 1) * sizeof(uint32_t), -1, &rsp, NULL, &u) < 0)
		return strict ? refused(EHOSTUNREACH) : real_listen(fd, backlog);
	if (rsp.err) {
		real_close(u);
		return refused(rsp.err);
	}
	set_nonblock(u, nonblocking(fd));
	if (swap(fd, u, false) == -2) {
		real_close(u);
		return -1;
	}
	e->kind = K_LISTEN;
	return 0;
}

/* slimfast_accept receives a host connection the router pushed. */
static int slimfast_accept(int fd, struct ent *e, struct sockaddr *sa, socklen_t *len, int flags)
{
	(void)e;
	struct slim_push p;
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(sizeof(int))];
	} c;
	memset(&c, 0, sizeof(c));
	struct iovec iov = {.iov_base = &p, .iov_len = sizeof(p)};
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = c.b, .msg_controllen = sizeof(c.b)};
	ssize_t n = recvmsg(fd, &m, (flags & SOCK_CLOEXEC) ? MSG_CMSG_CLOEXEC : 0);
	if (n < 0)
		return -1;
	struct cmsghdr *h = CMSG_FIRSTHDR(&m);
	int cfd = -1;
	if (h && h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_RIGHTS)
		memcpy(&cfd, CMSG_DATA(h), sizeof(int));
	if (n != (ssize_t)sizeof(p) || p.magic != SLIM_PUSH_MAGIC || cfd < 0) {
		if (cfd >= 0)
			real_close(cfd);
		return refused(ECONNABORTED);
	}
	if (flags & SOCK_NONBLOCK)
		set_nonblock(cfd, true);
	struct ent *ce = ent(cfd);
	struct sockaddr_in peer = {.sin_family = AF_INET, .sin_addr.s_addr = p.ip, .sin_port = htons(p.port)};
	if (ce) {
		pthread_mutex_lock(&mu);
		memset(ce, 0, sizeof(*ce));
		ce->kind = K_CONN, ce->hfd = ce->ofd = -1, ce->has_peer = true, ce->peer = peer;
		pthread_mutex_unlock(&mu);
	}
	if (sa && len) {
		memcpy(sa, &peer, *len < sizeof(peer) ? *len : sizeof(peer));
		*len = sizeof(peer);
	}
	return cfd;
}

/* slim_accept: the overlay connection first, the twin's host address to
 * the client on it, then the router's accept of the host connection. */
static int slim_accept(int fd, struct ent *e, struct sockaddr *sa, socklen_t *len, int flags)
{
	struct sockaddr_in peer;
	socklen_t pl = sizeof(peer);
	int c = real_accept4(fd, (struct sockaddr *)&peer, &pl, flags | SOCK_CLOEXEC);
	if (c < 0 || !in_cidr((struct sockaddr *)&peer, pl)) {
		if (c >= 0 && sa && len) {
			memcpy(sa, &peer, *len < pl ? *len : pl);
			*len = pl;
		}
		return c;
	}
	struct slim_disc d = {.magic = htons(SLIM_DISC_MAGIC), .port = e->bound.sin_port, .ip = e->bound.sin_addr.s_addr};
	struct slim_req r = req(OP_ACCEPT);
	r.flags = (flags & SOCK_NONBLOCK) ? SLIM_FLAG_NONBLOCK : 0;
	struct slim_rsp rsp;
	int h = -1;
	if (send(c, &d, sizeof(d), MSG_NOSIGNAL) != sizeof(d) || ask(&r, sizeof(r), e->hfd, &rsp, &h, NULL) < 0 || rsp.err || h < 0) {
		real_close(c);
		return refused(ECONNABORTED);
	}
	if (!(flags & SOCK_CLOEXEC))
		fcntl(h, F_SETFD, 0);
	struct ent *he = ent(h);
	if (he) {
		pthread_mutex_lock(&mu);
		memset(he, 0, sizeof(*he));
		he->kind = K_CONN, he->hfd = -1, he->ofd = c, he->has_peer = true, he->peer = peer;
		pthread_mutex_unlock(&mu);
	} else {
		real_close(c);
	}
	if (sa && len) {
		memcpy(sa, &peer, *len < sizeof(peer) ? *len : sizeof(peer));
		*len = sizeof(peer);
	}
	return h;
}

EXPORT int accept4(int fd, struct sockaddr *sa, socklen_t *len, int flags)
{
	struct ent *e = ent(fd);
	if (!e || e->kind != K_LISTEN)
		return real_accept4(fd, sa, len, flags);
	return design == SLIM ? slim_accept(fd, e, sa, len, flags) : slimfast_accept(fd, e, sa, len, flags);
}

EXPORT int accept(int fd, struct sockaddr *sa, socklen_t *len)
{
	return accept4(fd, sa, len, 0);
}

/* slim_connect: over the overlay first (blocking, as Slim's shim does),
 * the server's host address from it, then the twin connected there. */
static int slim_connect(int fd, struct ent *e, const struct sockaddr *sa, socklen_t len)
{
	bool nb = nonblocking(fd);
	if (nb)
		set_nonblock(fd, false);
	int rc = real_connect(fd, sa, len);
	struct slim_disc d;
	struct pollfd p = {.fd = fd, .events = POLLIN};
	bool got = rc == 0 && poll(&p, 1, WAIT_MS) == 1 && recv(fd, &d, sizeof(d), MSG_WAITALL) == sizeof(d) &&
		   d.magic == htons(SLIM_DISC_MAGIC);
	if (nb)
		set_nonblock(fd, true);
	if (rc < 0)
		return rc;
	if (!got)
		return refused(ECONNREFUSED); /* not a Slim server */
	if (nb)
		set_nonblock(e->hfd, true);
	struct slim_req r = req(OP_CONNECT);
	r.ip = d.ip;
	r.port = ntohs(d.port);
	struct slim_rsp rsp;
	if (ask(&r, sizeof(r), e->hfd, &rsp, NULL, NULL) < 0)
		return refused(EHOSTUNREACH);
	if (rsp.err && rsp.err != EINPROGRESS)
		return refused(rsp.err);
	int h = e->hfd;
	pthread_mutex_lock(&mu);
	e->hfd = -1;
	int old = swap(fd, h, true);
	e->kind = K_CONN, e->ofd = old, e->has_peer = true;
	memcpy(&e->peer, sa, sizeof(e->peer));
	pthread_mutex_unlock(&mu);
	if (old == -2)
		return refused(EBADF);
	return rsp.err ? refused(rsp.err) : 0;
}

/* slimfast_connect: the router's host connection to the destination's
 * host, SlimFast's header written, in place of the socket. */
static int slimfast_connect(int fd, struct ent *e, const struct sockaddr *sa, socklen_t len)
{
	const struct sockaddr_in *in = (const void *)sa;
	struct slim_req r = req(OP_FCONNECT);
	uint32_t me[1];
	r.ip = in->sin_addr.s_addr;
	r.port = ntohs(in->sin_port);
	r.src = own_addrs(me, 1) ? me[0] : 0;
	struct slim_rsp rsp;
	int h = -1;
	if (ask(&r, sizeof(r), -1, &rsp, &h, NULL) < 0)
		return strict ? refused(EHOSTUNREACH) : real_connect(fd, sa, len);
	if (rsp.err || h < 0)
		return refused(rsp.err ? rsp.err : ECONNREFUSED);
	replay_opts(e, h);
	set_nonblock(h, nonblocking(fd));
	pthread_mutex_lock(&mu);
	int old = swap(fd, h, false);
	e->kind = K_CONN, e->has_peer = true;
	memcpy(&e->peer, sa, sizeof(e->peer));
	pthread_mutex_unlock(&mu);
	return old == -2 ? refused(EBADF) : 0;
}

EXPORT int connect(int fd, const struct sockaddr *sa, socklen_t len)
{
	struct ent *e = ent(fd);
	if (e && e->kind == K_UFRESH && in_cidr(sa, len))
		return udp_connect(fd, e, sa, len);
	if (!e || e->kind != K_FRESH || !in_cidr(sa, len) || (design == SLIM && e->hfd < 0))
		return real_connect(fd, sa, len);
	return design == SLIM ? slim_connect(fd, e, sa, len) : slimfast_connect(fd, e, sa, len);
}

EXPORT int getpeername(int fd, struct sockaddr *sa, socklen_t *len)
{
	struct ent *e = ent(fd);
	if (!e || e->kind != K_CONN || !e->has_peer || !sa || !len)
		return real_getpeername(fd, sa, len);
	memcpy(sa, &e->peer, *len < sizeof(e->peer) ? *len : sizeof(e->peer));
	*len = sizeof(e->peer);
	return 0;
}

EXPORT int getsockname(int fd, struct sockaddr *sa, socklen_t *len)
{
	struct ent *e = ent(fd);
	if (e && e->kind == K_CONN && e->ofd >= 0)
		return real_getsockname(e->ofd, sa, len);
	return real_getsockname(fd, sa, len);
}

EXPORT int close(int fd)
{
	struct ent *e = ent(fd);
	if (e && e->kind != K_NONE) {
		pthread_mutex_lock(&mu);
		if (e->hfd >= 0)
			real_close(e->hfd);
		if (e->ofd >= 0)
			real_close(e->ofd);
		udp_forget(e);
		memset(e, 0, sizeof(*e));
		pthread_mutex_unlock(&mu);
	}
	return real_close(fd);
}
