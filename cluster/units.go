package cluster

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// Units as tc(8) writes them: rates in bits (bit, kbit, …; a bare number
// is bit/s) or bytes (bps, kbps, …) per second, SI multiples; sizes in
// bytes (b, kb or k, …; a bare number is bytes) or bits (bit, kbit, …),
// binary multiples.
var (
	rateUnits = map[string]float64{"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
		"bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
	sizeUnits = map[string]float64{"": 8, "b": 8, "k": 8 << 10, "kb": 8 << 10, "m": 8 << 20, "mb": 8 << 20, "g": 8 << 30, "gb": 8 << 30,
		"bit": 1, "kbit": 1 << 10, "mbit": 1 << 20, "gbit": 1 << 30}
)

// ParseRate reads a rate as tc writes it ("100mbit", "1gbit", "12.5mbps")
// in bit/s; "none" (or 0) is no limit.
func ParseRate(s string) (uint64, error) {
	if strings.EqualFold(s, "none") {
		return 0, nil
	}
	return parseUnit(s, rateUnits, "rate", "bit, kbit, mbit, gbit, tbit or bps, kbps, mbps, gbps, tbps")
}

// ParseSize reads a size as tc writes it ("64kb", "1mb", "800kbit") in bits.
func ParseSize(s string) (uint64, error) {
	return parseUnit(s, sizeUnits, "size", "b, kb, mb, gb (bytes) or bit, kbit, mbit, gbit")
}

func parseUnit(s string, units map[string]float64, what, known string) (uint64, error) {
	num := strings.TrimRightFunc(s, func(r rune) bool { return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' })
	unit, ok := units[strings.ToLower(s[len(num):])]
	if !ok {
		return 0, fmt.Errorf("%s %q: unknown unit %q (%s)", what, s, s[len(num):], known)
	}
	n, err := strconv.ParseFloat(num, 64)
	if err != nil || n < 0 || math.IsInf(n, 0) || math.IsNaN(n) {
		return 0, fmt.Errorf("%s %q: want a number, 0 or more, and a unit (%s)", what, s, known)
	}
	v := n * unit
	if v > math.MaxUint64/2 {
		return 0, fmt.Errorf("%s %q is too large", what, s)
	}
	return uint64(math.Round(v)), nil
}

// DefaultBurst is the burst of a rate given without one: 10 ms at the
// rate, at least MinBurst.
func DefaultBurst(rate uint64) uint64 {
	if rate == 0 {
		return 0
	}
	return max(rate/100, MinBurst)
}

// String writes l as skiff limit list shows it: "egress 100mbit/1mb".
func (l Limit) String() string {
	var parts []string
	for _, d := range []struct {
		name        string
		rate, burst uint64
	}{{"egress", l.EgressRate, l.EgressBurst}, {"ingress", l.IngressRate, l.IngressBurst}} {
		if d.rate != 0 {
			parts = append(parts, d.name+" "+FormatRate(d.rate)+" burst "+FormatSize(d.burst))
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

// FormatSize writes bits as a size: "128kb", or bits where bytes would
// not be whole.
func FormatSize(bits uint64) string {
	if bits%8 != 0 {
		return strconv.FormatUint(bits, 10) + "bit"
	}
	b := bits / 8
	for _, u := range []struct {
		name string
		v    uint64
	}{{"gb", 1 << 30}, {"mb", 1 << 20}, {"kb", 1 << 10}} {
		if b >= u.v && b%u.v == 0 {
			return strconv.FormatUint(b/u.v, 10) + u.name
		}
	}
	return strconv.FormatUint(b, 10) + "b"
}
