package limits

//go:generate go tool bpf2go -tags linux -target bpfel -cflags "-O2 -g -Wall -Werror" -type skl_limit -type skl_bucket -type skl_counter skl limits.c -- -I/usr/include/x86_64-linux-gnu -I../bpfinc
//go:generate go tool bpf2go -tags linux -target bpfel -cflags "-O2 -g -Wall -Werror" -type skq_class -type skq_counter skq qos.c -- -I/usr/include/x86_64-linux-gnu -I../bpfinc
//go:generate go tool bpf2go -tags linux -target bpfel -cflags "-O2 -g -Wall -Werror" -type skr_policer -type skr_counter skr police.c -- -I/usr/include/x86_64-linux-gnu -I../bpfinc
