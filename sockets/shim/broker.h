/* broker.h - what the broker's parts share (broker.c: the shim protocol,
 * the pool, the loop; seccomp.c: the seccomp agent). */
#ifndef SKIFF_BROKER_INTERNAL_H
#define SKIFF_BROKER_INTERNAL_H
#include <stdint.h>
#include <sys/types.h>

void logf_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
extern const char *g_name;
#define LOG(fmt, ...) logf_("skiff-broker[%s]: " fmt, g_name, ##__VA_ARGS__)

void st_add(int slot, uint64_t v);
extern volatile uint64_t *g_st;

/* A host socket from the pool (made on the spot if it is empty), or -1. */
int pool_take(void);
/* Secure mode (--refuse-privileged): the container, or process pid, may
 * hold CAP_NET_ADMIN or CAP_SYS_ADMIN in the host's user namespace. */
int sc_privileged(pid_t pid);
/* Whether the int option (level, name) of fd reads want. */
int sockopt_is(int fd, int level, int name, int want);
/* IP_TRANSPARENT on a bound host listener; 0 or an errno. */
int make_transparent(int fd);
extern uint64_t g_host_netns;       /* SO_NETNS_COOKIE of the host netns */
extern uint64_t g_container_netns;  /* and of the container's (its listener's) */
extern uint64_t g_inflight;         /* a notification the previous broker left unanswered, or 0 */
extern int g_keeper;                /* --keeper: every call continues */
extern uint32_t g_net, g_mask, g_ip; /* cluster network, its mask, the container's IP (network order) */

/* seccomp.c: serves the container's seccomp notifications (connect and
 * listen: docs/sockets.md, "Unmodified images"); listeners arrive on the
 * control socket skiffd holds the other end of. */
int sc_setup(int ctl);   /* 0, or -1 (logged) */
int sc_epoll(void);      /* what to poll: the control socket and the listeners */
void sc_ready(void);     /* serves what is ready; never blocks */
int sc_listeners(void);  /* listeners held */
#endif
