// Kernel types a TCP socket iterator (iter/tcp) reads, shared by skiff's
// eBPF programs (CO-RE: only the fields named), and the kfunc that ends a
// socket from one.
#pragma once

struct seq_file;
struct bpf_iter_meta {
	struct seq_file *seq;
} __attribute__((preserve_access_index));
struct sock_common {
	unsigned short skc_family;
	volatile unsigned char skc_state;
} __attribute__((preserve_access_index));
struct bpf_iter__tcp {
	struct bpf_iter_meta *meta;
	struct sock_common *sk_common;
} __attribute__((preserve_access_index));
struct tcp_sock;

extern int bpf_sock_destroy(struct sock_common *sk) __ksym;
