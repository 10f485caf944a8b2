package sockets

//go:generate go tool bpf2go -tags linux -target bpfel -cflags "-O2 -g -Wall -Werror" -type sks_key -type sks_rule -type sks_rules -type sks_tuple -type sks_pending -type sks_info -type sks_container -type sks_subnet -type sks_event -type sks_sock -type sks_role -type sks_event_kind sks sockets.c -- -I/usr/include/x86_64-linux-gnu -I../bpfinc
