/* The shim's side of package slim's wire formats (slim/proto.go): one
 * SOCK_SEQPACKET message per request and reply; integers little-endian
 * (host order on x86-64), addresses in network order, ports in host order. */
#pragma once
#include <stdint.h>

#define SLIM_MAGIC 0x4d494c53u /* "SLIM" */
#define SLIM_PUSH_MAGIC 0x55504653u /* "SFPU" */
#define SLIM_DISC_MAGIC 0x4c53u /* "SL": Slim's host address on the overlay connection */

enum {
	OP_SOCKET = 1,
	OP_BIND = 2,
	OP_ACCEPT = 3,
	OP_CONNECT = 4,
	OP_REGISTER = 16,
	OP_FCONNECT = 17,
	OP_USOCKET = 18,
	OP_ULOOKUP = 19,
};

#define SLIM_UDP_MAGIC 0x53465531u /* "SFU1", network order in the tag */
#define SLIM_TAG_LEN 16

/* SlimFast's UDP tag, in front of a datagram's payload (slim/proto.go Tag):
 * big-endian. Client -> relay: a = destination overlay, b = client overlay;
 * relay -> server: a = client overlay, b = client host; server -> client
 * (until the client sends direct): a = server overlay. */
struct slim_tag {
	uint32_t magic;
	uint32_t a_ip;
	uint16_t a_port;
	uint16_t b_port;
	uint32_t b_ip;
} __attribute__((packed));

#define SLIM_FLAG_NONBLOCK 1

struct slim_req { /* 24 bytes, then uint32_t extra[count] (REGISTER) */
	uint32_t magic;
	uint16_t op;
	uint16_t flags;
	uint32_t ip; /* network order */
	uint16_t port;
	uint16_t count;
	uint32_t src; /* network order */
	int32_t arg;
} __attribute__((packed));

struct slim_rsp { /* 16 bytes */
	int32_t err; /* 0 or an errno */
	uint32_t ip;
	uint16_t port;
	uint16_t relay; /* USOCKET: this host's relay port */
	uint32_t n;
} __attribute__((packed));

struct slim_push { /* 12 bytes, with the connection's fd */
	uint32_t magic;
	uint32_t ip;
	uint16_t port;
	uint16_t pad;
} __attribute__((packed));

struct slim_disc { /* 8 bytes, server shim to client shim on the overlay connection */
	uint16_t magic; /* network order */
	uint16_t port;  /* network order */
	uint32_t ip;    /* network order */
} __attribute__((packed));
