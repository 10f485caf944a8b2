package policymap

// The test programs only (verdict_test.c): the data path's programs
// include policymap.h and load its maps with theirs.
//go:generate go tool bpf2go -tags linux -target bpfel -cflags "-O2 -g -Wall -Werror" -type skp_lpm_key -type skp_vkey -output-suffix _test skpTest verdict_test.c -- -I/usr/include/x86_64-linux-gnu
