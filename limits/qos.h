// Types shared by qos.c and the Go loader (bpf2go -type).
#pragma once

// A container's QoS class, as skiff limit and CNI name it. Its packets
// leave the underlay with the class's DSCP (class selectors only: never
// the TOS bits skiff's layers use as marks) and skb->priority, which is
// both a pfifo_fast band (priority & 15 through the default priomap) and
// a class of the underlay's HTB (--underlay-rate).
enum skq_class {
	SKQ_NORMAL = 0, // untouched
	SKQ_HIGH = 1,   // CS4, TC_PRIO_INTERACTIVE (band 0), HTB 5c:6
	SKQ_LOW = 2,    // CS1, TC_PRIO_BULK (band 2), HTB 5c:2
};

enum skq_counter {
	SKQ_MARKED = 0,    // VXLAN packets of a classed container marked
	SKQ_UNCLASSED = 1, // VXLAN packets of containers of the normal class
	SKQ_NCOUNTERS = 2,
};
