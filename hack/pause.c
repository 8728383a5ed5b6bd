/* The node's pod sandbox process: holds the pod's namespaces, reaps orphans, exits on
 * SIGINT/SIGTERM. (No registry is reachable here, so the node builds its own pause image.) */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void quit(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction q = {.sa_handler = quit}, c = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  sigaction(SIGINT, &q, NULL);
  sigaction(SIGTERM, &q, NULL);
  sigaction(SIGCHLD, &c, NULL);
  for (;;) pause();
  return 0;
}
