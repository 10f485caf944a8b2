// A token bucket's refill and take, shared by the programs that police a
// rate (limits.c, police.c). The caller holds the bucket's spin lock.
#pragma once

#include <stdbool.h>

#define BUCKET_NSEC 1000000000ull

// bucket_take refills *tokens at rate bytes/s for the time since *last, in
// whole microseconds (rate < 2^37 bytes/s, 1 Tbit/s, times at most 10^6
// us fits 64 bits), at most a second's worth and never above burst, then
// takes len bytes if it holds them. *last advances only by the time the
// tokens added stand for, so a stream of packets closer together than one
// byte's worth of time still earns its tokens; a clock read before another
// CPU's later one (now < *last) adds nothing and never moves *last back. A
// bucket never used (*last 0) starts full.
static __always_inline bool bucket_take(__u64 *tokens_p, __u64 *last_p, __u64 rate, __u64 burst, __u64 len, __u64 now)
{
	__u64 last = *last_p, tokens = *tokens_p;
	__s64 since = now - last;
	if (last == 0 || since > (__s64)BUCKET_NSEC)
		since = BUCKET_NSEC;
	if (since > 0) {
		__u64 add = (__u64)since / 1000 * rate / 1000000;
		if (tokens + add >= burst) {
			tokens = burst;
			*last_p = now;
		} else if (add) {
			tokens += add;
			*last_p = last + add * 1000000 / rate * 1000;
		}
	}
	bool ok = tokens >= len;
	if (ok)
		tokens -= len;
	*tokens_p = tokens;
	return ok;
}
