// Types shared by the source check (source.c) and the agent (bpf2go
// generates the Go side from them).
#pragma once

// What a container may send from: its address and its interface's MAC.
struct source {
	__be32 ip;
	__u8 mac[6];
	__u8 pad[2];
};

// Why a packet was dropped. Names in Go: overlay/source.go.
enum skv_reason {
	SKV_NO_ENTRY,       // a veth with the program but no entry (fail closed)
	SKV_VLAN,           // 802.1Q/802.1ad tagged
	SKV_MAC_SOURCE,     // Ethernet source is not the container's MAC
	SKV_IP_SOURCE,      // IPv4 source is not the container's address
	SKV_ARP_SENDER,     // ARP sender (MAC or IPv4) is not the container's
	SKV_OTHER_PROTOCOL, // neither IPv4 nor ARP: IPv6 and everything else
	SKV_MALFORMED,      // too short for its headers, or ARP not Ethernet/IPv4
	SKV_NR_REASONS,
};
