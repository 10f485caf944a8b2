/* fdtab.c - libskiff.so's table of the descriptors it handed out: each
 * fresh or bound host socket's state, the options set on it and its epoll
 * registrations, which a fallback to a container socket replays.
 *
 * The table's memory comes from mmap, never malloc: close(), dup() and
 * socket() are async-signal-safe, and a handler may call them while the
 * thread it interrupted is inside malloc, holding its lock (`sockcheck
 * sigmalloc`). Blocks of 2^k bytes, 128 B to 8 KiB, each size on a free list
 * of its own, carved from 64 KiB chunks and never given back: the shim's
 * memory is its peak of fresh sockets.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>

#include "shim.h"

#define MEM_MIN_SHIFT 7
#define MEM_CLASSES   7
#define MEM_CHUNK     (64 * 1024)

static struct {
	pthread_mutex_t mu;
	struct fdent **ents;       /* by fd; mmap'd */
	int size;
	int ntracked;              /* atomic; 0 lets close()/dup() skip the lock */
	/* the memory, under mu */
	void *free[MEM_CLASSES];
	char *chunk;
	size_t chunk_left;
} tab = { .mu = PTHREAD_MUTEX_INITIALIZER };

int tab_tracking(void) { return __atomic_load_n(&tab.ntracked, __ATOMIC_RELAXED) > 0; }

static int tab_lock(void) { int p = shim_enter(); pthread_mutex_lock(&tab.mu); return p; }
static void tab_unlock(int p) { pthread_mutex_unlock(&tab.mu); shim_leave(p); }
void tab_fork_lock(void) { pthread_mutex_lock(&tab.mu); }
void tab_fork_unlock(void) { pthread_mutex_unlock(&tab.mu); }

/* ---------- memory (caller holds tab.mu) ---------- */
static void *mem_map(size_t n)
{
	void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	return p == MAP_FAILED ? NULL : p;
}

static int mem_class(size_t n)
{
	int k = 0;
	while (k < MEM_CLASSES && ((size_t)1 << (MEM_MIN_SHIFT + k)) < n) k++;
	return k;
}

/* n zeroed bytes, or NULL */
static void *mem_get(size_t n)
{
	int k = mem_class(n);
	if (k == MEM_CLASSES) return NULL;
	size_t sz = (size_t)1 << (MEM_MIN_SHIFT + k);
	void *p = tab.free[k];
	if (p) {
		tab.free[k] = *(void **)p;
		return memset(p, 0, sz);
	}
	if (tab.chunk_left < sz) {
		char *c = mem_map(MEM_CHUNK);   /* the old chunk's tail, < 8 KiB, is lost */
		if (!c) return NULL;
		tab.chunk = c;
		tab.chunk_left = MEM_CHUNK;
	}
	p = tab.chunk;   /* fresh from mmap: zero */
	tab.chunk += sz;
	tab.chunk_left -= sz;
	return p;
}

/* gives back a block mem_get(n) returned */
static void mem_put(void *p, size_t n)
{
	if (!p) return;
	int k = mem_class(n);
	*(void **)p = tab.free[k];
	tab.free[k] = p;
}

/* ---------- entries (caller holds tab.mu) ---------- */
static void ent_release_locked(struct fdent *e)
{
	if (!e) return;
	mem_put(e->opts, (size_t)e->capopts * sizeof *e->opts);
	mem_put(e, sizeof *e);
}

/* a cleared entry, or NULL */
static struct fdent *ent_new_locked(void) { return mem_get(sizeof(struct fdent)); }

void ent_free(struct fdent *e)
{
	if (!e) return;
	int p = tab_lock();
	ent_release_locked(e);
	tab_unlock(p);
}

static struct fdent *ent_clone_locked(const struct fdent *s)
{
	struct fdent *e = ent_new_locked();
	if (!e) return NULL;
	*e = *s;
	e->opts = NULL;
	e->capopts = 0;
	if (s->nopts) {
		e->opts = mem_get(s->capopts * sizeof *e->opts);
		if (!e->opts) { mem_put(e, sizeof *e); return NULL; }
		memcpy(e->opts, s->opts, s->nopts * sizeof *e->opts);
		e->capopts = s->capopts;
	}
	e->neps = 0;   /* registrations belong to the number, not the socket */
	return e;
}

static void ent_record_locked(struct fdent *e, int level, int name, const void *val, socklen_t len)
{
	if (len > SOPT_MAX || (len && !val)) { e->unreplayable = 1; return; }
	struct sopt *o = NULL;
	for (int i = 0; i < e->nopts; i++)
		if (e->opts[i].level == level && e->opts[i].name == name) { o = &e->opts[i]; break; }
	if (!o) {
		if (e->nopts >= NOPTS_MAX) { e->unreplayable = 1; return; }
		if (e->nopts == e->capopts) {
			int cap = e->capopts ? e->capopts * 2 : 4;
			struct sopt *n = mem_get(cap * sizeof *n);
			if (!n) { e->unreplayable = 1; return; }
			if (e->nopts) memcpy(n, e->opts, e->nopts * sizeof *n);
			mem_put(e->opts, e->capopts * sizeof *n);
			e->opts = n;
			e->capopts = cap;
		}
		o = &e->opts[e->nopts++];
		o->level = level;
		o->name = name;
	}
	o->len = len;
	if (len) memcpy(o->val, val, len);
}

/* Applies an epoll_ctl that succeeded to e's registrations. */
static void ent_epoll_locked(struct fdent *e, int epfd, int op, const struct epoll_event *ev)
{
	int i = 0;
	while (i < e->neps && e->eps[i].epfd != epfd) i++;
	if (op == EPOLL_CTL_DEL) {
		if (i < e->neps) e->eps[i] = e->eps[--e->neps];
		return;
	}
	if (i == e->neps) {
		if (op != EPOLL_CTL_ADD) return;
		if (e->neps == NEPOLL_MAX) { e->unreplayable = 1; return; }
		e->neps++;
		e->eps[i].epfd = epfd;
	}
	if (ev) e->eps[i].ev = *ev;
}

/* ---------- the table ---------- */
/* fd's entry, or NULL; caller holds tab.mu */
static struct fdent *tab_get_locked(int fd) { return fd >= 0 && fd < tab.size ? tab.ents[fd] : NULL; }

/* caller holds tab.mu */
static struct fdent *tab_detach_locked(int fd)
{
	struct fdent *e = tab_get_locked(fd);
	if (!e) return NULL;
	tab.ents[fd] = NULL;
	__atomic_sub_fetch(&tab.ntracked, 1, __ATOMIC_RELAXED);
	return e;
}

/* caller holds tab.mu; takes ownership of e (releases it on failure) */
static void tab_put_locked(int fd, struct fdent *e)
{
	if (fd < 0) { ent_release_locked(e); return; }
	if (fd >= tab.size) {
		int nsz = tab.size ? tab.size : 256;
		while (nsz <= fd) nsz *= 2;
		struct fdent **t = mem_map(nsz * sizeof *t);
		if (!t) { ent_release_locked(e); return; }   /* OOM: fd stays an untracked host socket */
		if (tab.ents) {
			memcpy(t, tab.ents, tab.size * sizeof *t);
			munmap(tab.ents, tab.size * sizeof *t);
		}
		tab.ents = t;
		tab.size = nsz;
	}
	ent_release_locked(tab_detach_locked(fd));
	tab.ents[fd] = e;
	__atomic_add_fetch(&tab.ntracked, 1, __ATOMIC_RELAXED);
}

int tab_track_fresh(int fd)
{
	int p = tab_lock();
	struct fdent *e = ent_new_locked();
	if (e) {
		e->state = ST_FRESH;
		tab_put_locked(fd, e);
	}
	tab_unlock(p);
	return e ? 0 : -1;
}

void tab_put(int fd, struct fdent *e)
{
	int p = tab_lock();
	tab_put_locked(fd, e);
	tab_unlock(p);
}

/* Take fd's entry out of the table (the caller owns it while it works on the
 * fd, so no lock is held across blocking calls).  Returns NULL if the fd is not
 * tracked.  The entry may be stale (the fd was closed behind our back, e.g. by
 * close_range/fclose, and the number now holds another file): passing the
 * app's calls through is harmless then, and hooks.c checks the socket before
 * it replaces one. */
struct fdent *tab_take(int fd)
{
	if (!tab_tracking()) return NULL;
	int p = tab_lock();
	struct fdent *e = tab_detach_locked(fd);
	tab_unlock(p);
	return e;
}

void tab_clear(int fd)
{
	if (!tab_tracking()) return;
	int p = tab_lock();
	ent_release_locked(tab_detach_locked(fd));
	tab_unlock(p);
}

/* dup semantics: newfd refers to the same socket as oldfd. Clears newfd first. */
void tab_dup(int oldfd, int newfd)
{
	if (!tab_tracking()) return;
	int p = tab_lock();
	ent_release_locked(tab_detach_locked(newfd));
	struct fdent *old = tab_get_locked(oldfd);
	if (old) {
		struct fdent *c = ent_clone_locked(old);
		if (c) tab_put_locked(newfd, c);
	}
	tab_unlock(p);
}

/* An option set on fd (fresh or bound), replayed if a connect swaps. */
void tab_record_opt(int fd, int level, int name, const void *val, socklen_t len)
{
	int p = tab_lock();
	struct fdent *e = tab_get_locked(fd);
	if (e) ent_record_locked(e, level, name, val, len);
	tab_unlock(p);
}

void tab_epoll(int fd, int epfd, int op, const struct epoll_event *ev)
{
	int p = tab_lock();
	struct fdent *e = tab_get_locked(fd);
	if (e) ent_epoll_locked(e, epfd, op, ev);
	tab_unlock(p);
}
