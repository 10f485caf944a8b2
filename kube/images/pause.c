/*
 * pause: the sandbox process of a pod (the infra container). It holds the
 * pod's namespaces, reaps the zombies that a shared PID namespace leaves it
 * as PID 1, and exits 0 on SIGINT or SIGTERM. scripts/kube-images.sh builds
 * it static into the pause image, so no registry is needed.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig)
{
	(void)sig;
	_exit(0);
}

static void reap(int sig)
{
	int saved = errno;
	(void)sig;
	while (waitpid(-1, NULL, WNOHANG) > 0)
		;
	errno = saved;
}

int main(int argc, char **argv)
{
	struct sigaction sa;

	if (argc > 1 && (strcmp(argv[1], "-v") == 0 || strcmp(argv[1], "--version") == 0)) {
		printf("pause (skiff)\n");
		return 0;
	}
	if (getpid() != 1)
		fprintf(stderr, "pause: warning: not PID 1\n");

	memset(&sa, 0, sizeof(sa));
	sigemptyset(&sa.sa_mask);
	sa.sa_handler = stop;
	if (sigaction(SIGINT, &sa, NULL) < 0 || sigaction(SIGTERM, &sa, NULL) < 0) {
		perror("pause: sigaction");
		return 1;
	}
	sa.sa_handler = reap;
	sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
	if (sigaction(SIGCHLD, &sa, NULL) < 0) {
		perror("pause: sigaction");
		return 2;
	}
	for (;;)
		pause();
	return 42; /* not reached */
}
