/* shim.h - the parts of libskiff.so and what they offer each other.
 *
 *   hooks.c   the interposed libc functions, the fallback to a container
 *             socket, init/fork/exit (the re-entrancy guard lives here)
 *   fdtab.c   the table of the descriptors the shim handed out (state,
 *             recorded options and epoll registrations; mmap'd memory)
 *   client.c  the broker connection, the pool of host sockets it sends,
 *             and the counters reported to it
 *
 * Each part keeps its state in one struct of its own; the library is built
 * with hidden visibility, so only the interposed functions are exported.
 */
#ifndef SKIFF_SHIM_H
#define SKIFF_SHIM_H
#include <netinet/in.h>
#include <stdint.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define BATCH       32      /* sockets per request (fewer under a small fd limit) */
#define SOPT_MAX    128     /* max recorded option value size */
#define NOPTS_MAX   32      /* max recorded options per fd */
#define NEPOLL_MAX  4       /* max recorded epoll registrations per fresh fd */

/* raw syscalls for the shim's own housekeeping: never interposed, never recurse */
static inline int sys_close(int fd) { return (int)syscall(SYS_close, fd); }
static inline int sys_fcntl(int fd, int cmd, long arg) { return (int)syscall(SYS_fcntl, fd, cmd, arg); }
static inline int sys_fstat(int fd, struct stat *st) { return (int)syscall(SYS_fstat, fd, st); }
static inline int sys_dup3(int o, int n, int fl) { return (int)syscall(SYS_dup3, o, n, fl); }

/* ---------- hooks.c: the re-entrancy guard ----------
 * Raised while the shim holds a lock, so that a signal handler calling
 * close()/socket() on this thread passes straight through instead of
 * deadlocking (a stale table entry is caught before the shim acts on its
 * fd). shim_enter returns the previous value for shim_leave. */
int shim_enter(void);
void shim_leave(int prev);

/* ---------- fdtab.c ---------- */
enum { ST_FRESH = 1, ST_BOUND = 2, ST_LISTENING = 3 };
struct sopt { int level, name; socklen_t len; unsigned char val[SOPT_MAX]; };
/* An epoll registration of the fd: a fallback's dup3 ends it with the host
 * socket, and gives it to the container socket. */
struct epreg { int epfd; struct epoll_event ev; };
struct fdent {
	int state;
	int unreplayable;          /* an option or registration we could not record */
	int has_bind;
	int transparent;           /* the broker made it IP_TRANSPARENT */
	struct sockaddr_in bindaddr;
	int nopts, capopts;
	struct sopt *opts;
	int neps;
	struct epreg eps[NEPOLL_MAX];
};

int tab_tracking(void);                       /* any fd tracked: 0 lets calls skip the lock */
int tab_track_fresh(int fd);                  /* a fresh host socket: 0, or -1 (no memory) */
struct fdent *tab_take(int fd);               /* the entry, now the caller's, or NULL */
void tab_put(int fd, struct fdent *e);        /* back into the table (takes e) */
void tab_clear(int fd);
void tab_dup(int oldfd, int newfd);           /* newfd is a duplicate of oldfd */
void tab_record_opt(int fd, int level, int name, const void *val, socklen_t len);
void tab_epoll(int fd, int epfd, int op, const struct epoll_event *ev);
void ent_free(struct fdent *e);
void tab_fork_lock(void);                     /* around fork: the table's lock */
void tab_fork_unlock(void);

/* ---------- client.c ---------- */
/* What the broker's hello said (written on connect, read racily: it only
 * changes on reconnect). */
struct hello_info {
	volatile uint32_t net, mask, ip;
	volatile uint64_t host_netns;
	volatile int have;
};
const struct hello_info *client_hello(void);

void client_init(const char *name, unsigned long fd_limit);
int client_take_socket(int type);             /* a fresh host socket at the lowest free fd, or -1 */
void client_drop_pool(void);                  /* the app needs the pool's fds */
int client_transparent(int fd);               /* IP_TRANSPARENT through the broker: 0 once set */
void client_count_replaced(void);
void client_count_fallback(int reason);
void client_flush(void);                      /* at exit: report the counters */
void client_fork_lock(void);
void client_fork_unlock(void);
void client_fork_child(void);                 /* the child's own connection and pool; unlocks */

#endif
