package channels

//go:generate go tool bpf2go -tags linux -target bpfel -cflags "-O2 -g -Wall -Werror" -type skch_key -type skch_sock -type skch_state -type skch_counter skch channels.c -- -I/usr/include/x86_64-linux-gnu -I../bpfinc
