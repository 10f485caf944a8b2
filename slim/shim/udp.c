/* SlimFast's UDP (TCC '23, §III-C, Fig. 8b/c) in libslim.so: datagrams
 * through host sockets, the first ones of a flow through the server host's
 * relay with a tag (slim_tag), then directly between the two host sockets.
 *
 * A server's socket (bound) becomes a host UDP socket the router registers
 * under the socket's overlay addresses. A client's socket (connected to an
 * overlay address) becomes a host UDP socket too; until it knows the
 * server's host socket it sends tagged datagrams to the server host's relay
 * (the router's UDP port), which hands them on tagged with the client's
 * overlay and host addresses. The server answers the client's host address
 * directly, tagged with its own overlay address until the client sends to
 * it directly: the client learns where to send from that tag. Receivers
 * strip tags and report overlay addresses, so the application sees only
 * the overlay. Only connected clients (send/recv, read/write, sendto
 * without an address) and bound servers (recvfrom/sendto) are taken. */
#include <arpa/inet.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "slim.h"

#define MAXCLIENTS 64
#define BUF (65536 + SLIM_TAG_LEN)

struct client {
	struct sockaddr_in host, ov;
	bool direct; /* it sent to this socket directly: replies go untagged */
};

struct udp {
	struct sockaddr_in self;  /* this socket's overlay address */
	struct sockaddr_in peer;  /* client: the server's overlay address */
	struct sockaddr_in relay; /* client: the server host's relay; server: this host's */
	struct sockaddr_in direct; /* client: the server's host socket, once known */
	bool have_direct;
	int n;
	struct client c[MAXCLIENTS]; /* server: clients, by host address */
};

static ssize_t (*real_sendto)(int, const void *, size_t, int, const struct sockaddr *, socklen_t);
static ssize_t (*real_recvfrom)(int, void *, size_t, int, struct sockaddr *, socklen_t *);
static ssize_t (*real_read)(int, void *, size_t);
static ssize_t (*real_write)(int, const void *, size_t);

#include <dlfcn.h>
__attribute__((constructor)) static void udp_init(void)
{
	real_sendto = dlsym(RTLD_NEXT, "sendto");
	real_recvfrom = dlsym(RTLD_NEXT, "recvfrom");
	real_read = dlsym(RTLD_NEXT, "read");
	real_write = dlsym(RTLD_NEXT, "write");
}

static bool same(const struct sockaddr_in *a, const struct sockaddr_in *b)
{
	return a->sin_addr.s_addr == b->sin_addr.s_addr && a->sin_port == b->sin_port;
}

static struct sockaddr_in sin4(uint32_t ip, uint16_t port_net)
{
	return (struct sockaddr_in){.sin_family = AF_INET, .sin_addr.s_addr = ip, .sin_port = port_net};
}

void udp_forget(struct ent *e)
{
	free(e->udp);
	e->udp = NULL;
}

/* host_socket takes a host UDP socket from the router (reg: the overlay
 * address to register it under, a server's; the connection stays open in
 * *conn) and puts it in place of fd. */
static int host_socket(int fd, struct ent *e, const struct sockaddr_in *reg, int *conn, struct sockaddr_in *bound, uint16_t *relay)
{
	struct {
		struct slim_req r;
		uint32_t extra[4];
	} m = {.r = req(OP_USOCKET)};
	size_t len = sizeof(m.r);
	if (reg) {
		uint32_t addrs[5];
		int n = 0;
		if (reg->sin_addr.s_addr == INADDR_ANY)
			n = own_addrs(addrs, 5);
		else
			addrs[n++] = reg->sin_addr.s_addr;
		if (n == 0)
			return refused(EADDRNOTAVAIL);
		m.r.ip = addrs[0];
		m.r.port = ntohs(reg->sin_port);
		m.r.count = n - 1;
		memcpy(m.extra, addrs + 1, (n - 1) * sizeof(uint32_t));
		len += (n - 1) * sizeof(uint32_t);
	}
	struct slim_rsp rsp;
	int h = -1;
	if (ask(&m.r, len, -1, &rsp, &h, conn) < 0)
		return refused(EHOSTUNREACH);
	if (rsp.err || h < 0) {
		if (conn && *conn >= 0)
			real_close(*conn);
		return refused(rsp.err ? rsp.err : EHOSTUNREACH);
	}
	*bound = sin4(rsp.ip, htons(rsp.port));
	*relay = htons(rsp.relay);
	replay_opts(e, h);
	set_nonblock(h, nonblocking(fd));
	if (swap(fd, h, false) == -2) {
		real_close(h);
		return refused(EBADF);
	}
	return 0;
}

/* udp_bind: a server's socket (bound already, in the container) becomes a
 * registered host socket. */
int udp_bind(int fd, struct ent *e, const struct sockaddr *sa, socklen_t len)
{
	struct sockaddr_in me;
	socklen_t ml = sizeof(me);
	const struct sockaddr_in *in = (const void *)sa;
	if (len < sizeof(*in) || (!in_cidr(sa, len) && in->sin_addr.s_addr != INADDR_ANY) ||
	    real_getsockname(fd, (struct sockaddr *)&me, &ml) < 0 || !me.sin_port)
		return 0; /* stays the container's own socket */
	struct udp *u = calloc(1, sizeof(*u));
	if (!u)
		return 0;
	int conn = -1;
	struct sockaddr_in bound;
	uint16_t relay;
	if (host_socket(fd, e, &me, &conn, &bound, &relay) < 0) {
		free(u);
		return strict ? -1 : 0;
	}
	uint32_t self;
	u->self = sin4(me.sin_addr.s_addr ? me.sin_addr.s_addr : (own_addrs(&self, 1) ? self : 0), me.sin_port);
	u->relay = sin4(bound.sin_addr.s_addr, relay);
	pthread_mutex_lock(&mu);
	e->kind = K_USRV, e->hfd = conn, e->udp = u;
	pthread_mutex_unlock(&mu);
	return 0;
}

/* udp_connect: a client's socket becomes a host socket that sends to the
 * server host's relay until it learns the server's host socket. */
int udp_connect(int fd, struct ent *e, const struct sockaddr *sa, socklen_t len)
{
	(void)len;
	const struct sockaddr_in *to = (const void *)sa;
	struct slim_req r = req(OP_ULOOKUP);
	r.ip = to->sin_addr.s_addr;
	struct slim_rsp rsp;
	if (ask(&r, sizeof(r), -1, &rsp, NULL, NULL) < 0 || rsp.err)
		return refused(rsp.err && rsp.err != 0 ? rsp.err : EHOSTUNREACH);
	struct udp *u = calloc(1, sizeof(*u));
	if (!u)
		return refused(ENOMEM);
	u->peer = *to;
	u->relay = sin4(rsp.ip, htons(rsp.port));
	struct sockaddr_in bound;
	uint16_t relay;
	if (host_socket(fd, e, NULL, NULL, &bound, &relay) < 0) {
		free(u);
		return -1;
	}
	uint32_t self;
	u->self = sin4(own_addrs(&self, 1) ? self : 0, bound.sin_port);
	pthread_mutex_lock(&mu);
	e->kind = K_UCLI, e->udp = u;
	pthread_mutex_unlock(&mu);
	return 0;
}

static struct slim_tag tag(const struct sockaddr_in *a, const struct sockaddr_in *b)
{
	struct slim_tag t = {.magic = htonl(SLIM_UDP_MAGIC), .a_ip = a->sin_addr.s_addr, .a_port = a->sin_port};
	if (b)
		t.b_ip = b->sin_addr.s_addr, t.b_port = b->sin_port;
	return t;
}

static ssize_t send_tagged(int fd, const struct slim_tag *t, const void *buf, size_t len, int flags, const struct sockaddr_in *to)
{
	struct iovec iov[2] = {{.iov_base = (void *)t, .iov_len = sizeof(*t)}, {.iov_base = (void *)buf, .iov_len = len}};
	struct msghdr m = {.msg_name = (void *)to, .msg_namelen = sizeof(*to), .msg_iov = iov, .msg_iovlen = 2};
	ssize_t n = sendmsg(fd, &m, flags);
	return n < 0 ? n : (ssize_t)len;
}

/* udp_send sends buf to the overlay address to (NULL: the connected peer). */
static ssize_t udp_send(int fd, struct ent *e, const void *buf, size_t len, int flags, const struct sockaddr_in *to)
{
	struct udp *u = e->udp;
	if (e->kind == K_UCLI) {
		if (u->have_direct)
			return real_sendto(fd, buf, len, flags, (struct sockaddr *)&u->direct, sizeof(u->direct));
		struct slim_tag t = tag(&u->peer, &u->self);
		return send_tagged(fd, &t, buf, len, flags, &u->relay);
	}
	if (!to)
		return refused(EDESTADDRREQ);
	pthread_mutex_lock(&mu);
	struct client c = {0};
	bool found = false;
	for (int i = 0; i < u->n && !found; i++)
		if (same(&u->c[i].ov, to))
			c = u->c[i], found = true;
	pthread_mutex_unlock(&mu);
	if (!found)
		return refused(EHOSTUNREACH); /* a server answers clients that wrote to it */
	if (c.direct)
		return real_sendto(fd, buf, len, flags, (struct sockaddr *)&c.host, sizeof(c.host));
	struct slim_tag t = tag(&u->self, NULL);
	return send_tagged(fd, &t, buf, len, flags, &c.host);
}

static __thread unsigned char rbuf[BUF];

/* udp_recv receives a datagram, strips a tag, and reports the overlay
 * address it came from. */
static ssize_t udp_recv(int fd, struct ent *e, void *buf, size_t len, int flags, struct sockaddr *from, socklen_t *fromlen)
{
	struct udp *u = e->udp;
	struct sockaddr_in src;
	socklen_t sl = sizeof(src);
	ssize_t n = real_recvfrom(fd, rbuf, sizeof(rbuf), flags & ~MSG_TRUNC, (struct sockaddr *)&src, &sl);
	if (n < 0)
		return n;
	const struct slim_tag *t = (const void *)rbuf;
	bool tagged = n >= SLIM_TAG_LEN && t->magic == htonl(SLIM_UDP_MAGIC);
	struct sockaddr_in ov = src;
	size_t skip = 0;
	pthread_mutex_lock(&mu);
	if (e->kind == K_UCLI) {
		struct sockaddr_in a = sin4(t->a_ip, t->a_port);
		if (tagged && same(&a, &u->peer)) { /* the server's reply, from its host socket */
			u->direct = src, u->have_direct = true;
			skip = SLIM_TAG_LEN;
		}
		if (u->have_direct && same(&src, &u->direct))
			ov = u->peer;
	} else if (tagged && same(&src, &u->relay)) { /* a client's datagram through the relay */
		struct sockaddr_in cov = sin4(t->a_ip, t->a_port), chost = sin4(t->b_ip, t->b_port);
		int i = 0;
		while (i < u->n && !same(&u->c[i].host, &chost))
			i++;
		if (i == u->n && u->n < MAXCLIENTS)
			u->n++;
		if (i < u->n)
			u->c[i] = (struct client){.host = chost, .ov = cov};
		ov = cov;
		skip = SLIM_TAG_LEN;
	} else {
		for (int i = 0; i < u->n; i++)
			if (same(&u->c[i].host, &src)) { /* a client that knows this socket */
				u->c[i].direct = true;
				ov = u->c[i].ov;
				break;
			}
	}
	pthread_mutex_unlock(&mu);
	size_t got = (size_t)n - skip, copy = got < len ? got : len;
	memcpy(buf, rbuf + skip, copy);
	if (from && fromlen) {
		memcpy(from, &ov, *fromlen < sizeof(ov) ? *fromlen : sizeof(ov));
		*fromlen = sizeof(ov);
	}
	return (flags & MSG_TRUNC) ? (ssize_t)got : (ssize_t)copy;
}

static struct ent *udp_ent(int fd)
{
	struct ent *e = ent(fd);
	return (e && (e->kind == K_UCLI || e->kind == K_USRV) && e->udp) ? e : NULL;
}

EXPORT ssize_t sendto(int fd, const void *buf, size_t len, int flags, const struct sockaddr *to, socklen_t tolen)
{
	struct ent *e = udp_ent(fd);
	if (!e)
		return real_sendto(fd, buf, len, flags, to, tolen);
	return udp_send(fd, e, buf, len, flags, (to && tolen >= sizeof(struct sockaddr_in)) ? (const void *)to : NULL);
}

EXPORT ssize_t send(int fd, const void *buf, size_t len, int flags)
{
	return sendto(fd, buf, len, flags, NULL, 0);
}

EXPORT ssize_t recvfrom(int fd, void *buf, size_t len, int flags, struct sockaddr *from, socklen_t *fromlen)
{
	struct ent *e = udp_ent(fd);
	if (!e)
		return real_recvfrom(fd, buf, len, flags, from, fromlen);
	return udp_recv(fd, e, buf, len, flags, from, fromlen);
}

EXPORT ssize_t recv(int fd, void *buf, size_t len, int flags)
{
	return recvfrom(fd, buf, len, flags, NULL, NULL);
}

EXPORT ssize_t read(int fd, void *buf, size_t len)
{
	struct ent *e = udp_ent(fd);
	return e ? udp_recv(fd, e, buf, len, 0, NULL, NULL) : real_read(fd, buf, len);
}

EXPORT ssize_t write(int fd, const void *buf, size_t len)
{
	struct ent *e = udp_ent(fd);
	return e ? udp_send(fd, e, buf, len, 0, NULL) : real_write(fd, buf, len);
}
