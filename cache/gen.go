package cache

//go:generate go tool bpf2go -tags linux -target bpfel -cflags "-O2 -g -Wall -Werror" -type flow_key -type filter_val -type egress_host -type ingress_ep -type control -type flow_state -type rw_pair_key -type rw_pair -type rw_key_key -type rw_key -type reason skc cache.c -- -I/usr/include/x86_64-linux-gnu
