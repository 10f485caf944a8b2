package steering

//go:generate go tool bpf2go -tags linux -target bpfel -cflags "-O2 -g -Wall -Werror" -type stx_cfg -type stx_flow -type stx_load -type stx_stage -type stx_reason -type stx_last stx steering.c -- -I/usr/include/x86_64-linux-gnu
