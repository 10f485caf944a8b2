// skiff's private socket options: a level no protocol has ("SK"), answered
// or taken by skiff's cgroup sockopt programs; a kernel without those
// programs refuses it (ENOPROTOOPT). Plain numbers, no includes: the broker
// (C) and the eBPF programs share it.
#pragma once

#define SKIFF_SOL 0x534b

// getsockopt: which options of sockets/optset.h a socket set (the sockets
// layer's sks_getsockopt answers; the seccomp agent asks).
#define SKIFF_SO_OPTSET 1

// setsockopt: keep this socket, and the connections a listener accepts, out
// of same-host channels (channels' skch_setsockopt records it). The seccomp
// agent sets it on every host socket it takes: a channelled socket's
// blocking read can fail with a spurious EAGAIN on Linux 6.18, which only
// the shim retries (docs/channels.md).
#define SKIFF_SO_NOCHANNEL 2
