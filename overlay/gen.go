package overlay

//go:generate go tool bpf2go -tags linux -target bpfel -cflags "-O2 -g -Wall -Werror" -type source skv source.c -- -I/usr/include/x86_64-linux-gnu
