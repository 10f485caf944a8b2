//go:build ignore

/* skiff-seccomp-exec: runs a program under skiff's seccomp filter and hands
 * the filter's notification listener to skiffd, as an OCI runtime does for
 * a profile with linux.seccomp.listenerPath (runc, crun). For processes no
 * runtime starts: the lab's and skiff bench's containers, tests.
 *
 *   skiff-seccomp-exec --filter FILE --socket PATH [--id ID] [--pid PID] -- PROG [ARG...]
 *
 * --pid names another process as the container's in the state (a runtime
 * names the container's init; the default is the launcher itself).
 * FILE holds the filter as struct sock_filter[] (skiff seccomp-profile
 * --bpf). The process must already be in the container's network namespace
 * and cgroup: skiffd finds the container from them. If skiffd does not take
 * the listener, the program does not run (as with a runtime).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>

#define MAX_INSNS 4096

static void die(const char *fmt, const char *arg)
{
	fprintf(stderr, "skiff-seccomp-exec: ");
	fprintf(stderr, fmt, arg, strerror(errno));
	fputc('\n', stderr);
	exit(126);
}

int main(int argc, char **argv)
{
	static const struct option opts[] = { { "filter", required_argument, 0, 'f' },
					      { "socket", required_argument, 0, 's' },
					      { "id", required_argument, 0, 'i' },
					      { "pid", required_argument, 0, 'p' },
					      { 0, 0, 0, 0 } };
	const char *filter = NULL, *sock = NULL, *id = "skiff-seccomp-exec";
	int o, pid = getpid();
	while ((o = getopt_long(argc, argv, "+", opts, NULL)) != -1) {
		switch (o) {
		case 'f': filter = optarg; break;
		case 's': sock = optarg; break;
		case 'i': id = optarg; break;
		case 'p': pid = atoi(optarg); break;
		default:
			fprintf(stderr, "usage: skiff-seccomp-exec --filter FILE --socket PATH [--id ID] [--pid PID] -- PROG [ARG...]\n");
			return 2;
		}
	}
	if (!filter || !sock || optind >= argc) {
		fprintf(stderr, "usage: skiff-seccomp-exec --filter FILE --socket PATH [--id ID] [--pid PID] -- PROG [ARG...]\n");
		return 2;
	}
	for (const char *c = id; *c; c++)
		if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') || strchr("._-", *c))) {
			fprintf(stderr, "skiff-seccomp-exec: --id: letters, digits, '.', '_' and '-' only\n");
			return 2;
		}
	static struct sock_filter insns[MAX_INSNS + 1];
	int fd = open(filter, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		die("open %s: %s", filter);
	ssize_t n = read(fd, insns, sizeof insns);
	close(fd);
	if (n <= 0 || n % sizeof insns[0] || n > (ssize_t)(MAX_INSNS * sizeof insns[0])) {
		errno = EINVAL;
		die("%s: not a filter: %s", filter);
	}
	struct sock_fprog prog = { .len = (unsigned short)(n / sizeof insns[0]), .filter = insns };
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
		die("no_new_privs%s: %s", "");
	int lfd = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, &prog);
	if (lfd < 0)
		die("install the filter%s: %s", "");

	/* the hand-off, as runc sends it: ContainerProcessState and the fd */
	char state[1024];
	int len = snprintf(state, sizeof state,
			   "{\"ociVersion\":\"1.0.2\",\"fds\":[\"seccompFd\"],\"pid\":%d,\"metadata\":\"skiff/v1\","
			   "\"state\":{\"ociVersion\":\"1.0.2\",\"id\":\"%s\",\"status\":\"creating\",\"pid\":%d,\"bundle\":\"\"}}",
			   pid, id, pid);
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	if (strlen(sock) >= sizeof sa.sun_path) {
		errno = ENAMETOOLONG;
		die("%s: %s", sock);
	}
	strcpy(sa.sun_path, sock);
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (s < 0 || connect(s, (struct sockaddr *)&sa, sizeof sa) < 0)
		die("failed to connect with seccomp agent %s: %s", sock);
	char cbuf[CMSG_SPACE(sizeof(int))] = { 0 };
	struct iovec iov = { state, (size_t)len };
	struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf };
	struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(cm), &lfd, sizeof lfd);
	if (sendmsg(s, &m, MSG_NOSIGNAL) != len)
		die("send to the seccomp agent %s: %s", sock);
	close(s);
	close(lfd);
	execvp(argv[optind], argv + optind);
	die("exec %s: %s", argv[optind]);
}
