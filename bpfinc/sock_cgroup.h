// A socket's cgroup v2 id, read through the kernel's types (CO-RE: only
// the fields named), for programs that have a struct tcp_sock
// (bpf_skc_to_tcp_sock).
#pragma once

struct kernfs_node {
	__u64 id;
} __attribute__((preserve_access_index));
struct cgroup {
	struct kernfs_node *kn;
} __attribute__((preserve_access_index));
struct sock_cgroup_data {
	struct cgroup *cgroup;
} __attribute__((preserve_access_index));
struct sock {
	struct sock_cgroup_data sk_cgrp_data;
} __attribute__((preserve_access_index));
struct tcp_sock;

// sock_cgroup returns the cgroup v2 id of a socket (0 for none).
static __always_inline __u64 sock_cgroup(struct tcp_sock *tp)
{
	if (!tp)
		return 0;
	return ((struct sock *)tp)->sk_cgrp_data.cgroup->kn->id;
}
