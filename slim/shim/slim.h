/* Shared by slim.c (TCP) and udp.c (SlimFast's UDP): libslim.so's table
 * of the application's sockets and its helpers. */
#pragma once
#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include "slim_proto.h"

#define EXPORT __attribute__((visibility("default")))
#define MAXFD 65536
#define MAXOPT 6
#define MAXEP 2
#define WAIT_MS 5000

enum design { NONE, SLIM, SLIMFAST };
enum kind { K_NONE, K_FRESH, K_LISTEN, K_CONN, K_UFRESH, K_UCLI, K_USRV };

struct opt {
	int level, name;
	socklen_t len;
	unsigned char v[16];
};

struct udp; /* udp.c */

struct ent {
	unsigned char kind;
	int hfd; /* Slim: the host twin of a fresh or listening socket; UDP server: its registration */
	int ofd; /* after the swap: the overlay socket, for names (Slim) */
	bool has_peer;
	struct sockaddr_in peer, bound; /* bound: a Slim listener twin's host address */
	int nopt;
	struct opt opt[MAXOPT]; /* SlimFast: options to set again on the host socket */
	int nep;
	struct {
		int epfd;
		struct epoll_event ev;
	} ep[MAXEP];
	struct udp *udp;
};

extern enum design design;
extern bool strict;
extern pthread_mutex_t mu;

extern int (*real_socket)(int, int, int);
extern int (*real_bind)(int, const struct sockaddr *, socklen_t);
extern int (*real_connect)(int, const struct sockaddr *, socklen_t);
extern int (*real_close)(int);
extern int (*real_getsockname)(int, struct sockaddr *, socklen_t *);

struct ent *ent(int fd);
bool in_cidr(const struct sockaddr *sa, socklen_t len);
struct slim_req req(uint16_t op);
int ask(const struct slim_req *req, size_t len, int fd_in, struct slim_rsp *rsp, int *fd_out, int *conn);
int refused(int err);
int own_addrs(uint32_t *out, int max);
int swap(int fd, int h, bool keep);
void set_nonblock(int fd, bool on);
bool nonblocking(int fd);
void replay_opts(struct ent *e, int h);

/* udp.c */
int udp_bind(int fd, struct ent *e, const struct sockaddr *sa, socklen_t len);
int udp_connect(int fd, struct ent *e, const struct sockaddr *sa, socklen_t len);
void udp_forget(struct ent *e);
