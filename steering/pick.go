package steering

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// MaxCPUs is how many CPUs the programs can steer among (STX_MAX_CPUS).
const MaxCPUs = 64

// The Go side of the programs' arithmetic (steering.c): the tests check
// one against the other, and skiff steering explains a flow's placement
// with it.

func mix32(h uint32) uint32 {
	h ^= h >> 16
	h *= 0x85ebca6b
	h ^= h >> 13
	h *= 0xc2b2ae35
	h ^= h >> 16
	return h
}

// scale is the kernel's reciprocal_scale: the index RPS takes for hash h
// among n CPUs.
func scale(h, n uint32) uint32 { return uint32(uint64(h) * uint64(n) >> 32) }

// hashForIndex is the hash the programs write for index idx among n CPUs
// for a flow whose salted hash is h: RPS maps it back to idx.
func hashForIndex(idx, n, h uint32) uint32 {
	return uint32(((uint64(idx)<<32)+uint64(n)-1)/uint64(n)) + 1 + h&0x1ffffff
}

// Flow is an IPv4 flow as the programs hash it.
type Flow struct {
	Src, Dst     netip.Addr
	Proto        uint8
	Sport, Dport uint16
	Fragment     bool // hashed without ports
}

// hash is flow_at's with the configuration's seed: the addresses and the
// ports as the program loads them from the packet (network order in
// memory, read natively).
func (f Flow) hash(seed uint32) uint32 {
	s, d := f.Src.As4(), f.Dst.As4()
	h := mix32(binary.NativeEndian.Uint32(s[:]) ^ mix32(binary.NativeEndian.Uint32(d[:])^uint32(f.Proto)^seed))
	if f.Fragment || (f.Proto != 6 && f.Proto != 17) {
		return h
	}
	var p [4]byte
	binary.BigEndian.PutUint16(p[0:], f.Sport)
	binary.BigEndian.PutUint16(p[2:], f.Dport)
	return mix32(h ^ binary.NativeEndian.Uint32(p[:]))
}

// firstChoice is the index a stage's device (salt: its ifindex) gives the
// flow before loads are considered.
func firstChoice(flow, salt, n uint32) uint32 { return scale(mix32(flow^salt), n) }

// secondChoice is the other index the two-choice rule considers.
func secondChoice(flow, salt, n uint32) uint32 {
	h1 := mix32(flow ^ salt)
	return (scale(h1, n) + 1 + mix32(h1)%(n-1)) % n
}

// FormatMask writes CPUs as an rps_cpus mask: comma-separated groups of 32
// bits in hexadecimal, the highest first.
func FormatMask(cpus []int) string {
	top := slices.Max(append([]int{0}, cpus...))
	groups := make([]uint32, top/32+1)
	for _, c := range cpus {
		groups[c/32] |= 1 << (c % 32)
	}
	var parts []string
	for i := len(groups) - 1; i >= 0; i-- {
		if i == len(groups)-1 {
			parts = append(parts, strconv.FormatUint(uint64(groups[i]), 16))
		} else {
			parts = append(parts, fmt.Sprintf("%08x", groups[i]))
		}
	}
	return strings.Join(parts, ",")
}

// ParseMask reads an rps_cpus (or cpumask) file's content: the CPUs set,
// ascending (the order of the kernel's RPS map).
func ParseMask(s string) ([]int, error) {
	parts := strings.Split(strings.TrimSpace(s), ",")
	var cpus []int
	for i := range parts {
		g := parts[len(parts)-1-i]
		v, err := strconv.ParseUint(g, 16, 32)
		if err != nil || g == "" {
			return nil, fmt.Errorf("cpu mask %q: group %q is not 32 bits of hexadecimal", s, g)
		}
		for b := uint32(v); b != 0; b &= b - 1 {
			cpus = append(cpus, i*32+bits.TrailingZeros32(b))
		}
	}
	slices.Sort(cpus)
	return cpus, nil
}
