/* eagain.so - fault injection for test.sh, preloaded after libskiff.so:
 * the first read of each stream socket (read, readv, recv, recvfrom,
 * recvmsg and the _FORTIFY_SOURCE versions) fails with EAGAIN without
 * reading, as a blocking read of a channelled socket does on Linux 6.18
 * when woken without data.  Everything else goes to the kernel. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

static unsigned char g_failed[4096];

static int fail_once(int fd)
{
	int type = 0;
	socklen_t tl = sizeof type;
	if (fd < 0 || fd >= (int)sizeof g_failed || g_failed[fd] ||
	    getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) != 0 || type != SOCK_STREAM)
		return 0;
	g_failed[fd] = 1;
	errno = EAGAIN;
	return 1;
}

int close(int fd)
{
	if (fd >= 0 && fd < (int)sizeof g_failed) g_failed[fd] = 0;
	return (int)syscall(SYS_close, fd);
}

ssize_t read(int fd, void *b, size_t n) { return fail_once(fd) ? -1 : syscall(SYS_read, fd, b, n); }
ssize_t readv(int fd, const struct iovec *v, int n) { return fail_once(fd) ? -1 : syscall(SYS_readv, fd, v, n); }
ssize_t recvfrom(int fd, void *b, size_t n, int fl, struct sockaddr *sa, socklen_t *sl)
{
	return fail_once(fd) ? -1 : syscall(SYS_recvfrom, fd, b, n, fl, sa, sl);
}
ssize_t recv(int fd, void *b, size_t n, int fl) { return fail_once(fd) ? -1 : syscall(SYS_recvfrom, fd, b, n, fl, NULL, NULL); }
ssize_t recvmsg(int fd, struct msghdr *m, int fl) { return fail_once(fd) ? -1 : syscall(SYS_recvmsg, fd, m, fl); }
/* (Raw system calls throughout: a call through the PLT would land in the
 * shim again, and the shim's own wrapper would not be the one tested.) */
ssize_t __read_chk(int fd, void *b, size_t n, size_t bl) { (void)bl; return fail_once(fd) ? -1 : syscall(SYS_read, fd, b, n); }
ssize_t __recv_chk(int fd, void *b, size_t n, size_t bl, int fl)
{
	(void)bl;
	return fail_once(fd) ? -1 : syscall(SYS_recvfrom, fd, b, n, fl, NULL, NULL);
}
ssize_t __recvfrom_chk(int fd, void *b, size_t n, size_t bl, int fl, struct sockaddr *sa, socklen_t *sl)
{
	(void)bl;
	return fail_once(fd) ? -1 : syscall(SYS_recvfrom, fd, b, n, fl, sa, sl);
}
