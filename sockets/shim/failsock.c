/* failsock.so - fault injection for test.sh, preloaded into skiff-broker:
 * every AF_INET socket() fails with EMFILE, as when the broker has reached
 * its file limit.  Everything else goes to the kernel. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

int socket(int domain, int type, int protocol)
{
	if (domain == AF_INET) {
		errno = EMFILE;
		return -1;
	}
	return (int)syscall(SYS_socket, domain, type, protocol);
}
