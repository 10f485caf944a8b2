package cluster

// A container's rate limits, as a runtime asks for them through the CNI
// bandwidth capability (the reference bandwidth plugin's and Kubernetes'
// convention: rates in bit/s, bursts in bits), and its QoS class: read and
// checked here; package limits puts them on the data path.

import (
	"errors"
	"fmt"
	"math"
	"sort"
	"strconv"
)

// Limit is a container's rate limit in each direction; a zero rate is no
// limit in that direction.
type Limit struct {
	EgressRate   uint64 `json:"egressRate,omitempty"`   // bit/s
	EgressBurst  uint64 `json:"egressBurst,omitempty"`  // bits
	IngressRate  uint64 `json:"ingressRate,omitempty"`  // bit/s
	IngressBurst uint64 `json:"ingressBurst,omitempty"` // bits
	// Class is the QoS class (ClassHigh, ClassNormal, ClassLow; "" is
	// normal): not a limit of rate, but set and stored with it.
	Class string `json:"class,omitempty"`
}

// Bounds of what a limit may say.
const (
	MinRate  = 8_000             // bit/s: below, a single full-size packet takes over 1.5 s
	MaxRate  = 1_000_000_000_000 // 1 Tbit/s
	MaxBurst = 32 << 30          // bits (4 GiB), the reference plugin's bound
	// MinBurst is what a burst is raised to (Clamp): two 64 KiB GSO
	// segments, or no TSO-sized packet would ever pass.
	MinBurst = 2 * (64 << 10) * 8
)

// None reports whether l limits nothing.
func (l Limit) None() bool { return l.EgressRate == 0 && l.IngressRate == 0 }

// Validate checks both directions: a rate needs a burst and a burst a rate
// (the reference plugin's rule), both within bounds.
func (l Limit) Validate() error {
	return errors.Join(direction("egress", l.EgressRate, l.EgressBurst), direction("ingress", l.IngressRate, l.IngressBurst), ValidateClass(l.Class))
}

func direction(name string, rate, burst uint64) error {
	switch {
	case rate == 0 && burst == 0:
		return nil
	case rate == 0:
		return fmt.Errorf("%s burst %d bits without a rate: give %sRate too", name, burst, name)
	case burst == 0:
		return fmt.Errorf("%s rate %s without a burst: give %sBurst too", name, FormatRate(rate), name)
	case rate < MinRate:
		return fmt.Errorf("%s rate %s is below %s", name, FormatRate(rate), FormatRate(MinRate))
	case rate > MaxRate:
		return fmt.Errorf("%s rate %s is above %s", name, FormatRate(rate), FormatRate(MaxRate))
	case burst > MaxBurst:
		return fmt.Errorf("%s burst %d bits is above %d (4 GiB)", name, burst, uint64(MaxBurst))
	}
	return nil
}

// Clamp returns l with each burst within what the data path can use: at
// least MinBurst, and at most one second at the rate (Kubernetes passes
// 2^31-1 bits for a burst it was not given).
func (l Limit) Clamp() Limit {
	clamp := func(rate, burst uint64) uint64 {
		if rate == 0 {
			return 0
		}
		return max(min(burst, max(rate, MinBurst)), MinBurst)
	}
	l.EgressBurst, l.IngressBurst = clamp(l.EgressRate, l.EgressBurst), clamp(l.IngressRate, l.IngressBurst)
	return l
}

// cniKeys are the bandwidth capability's keys.
var cniKeys = map[string]func(*Limit) *uint64{
	"egressRate":   func(l *Limit) *uint64 { return &l.EgressRate },
	"egressBurst":  func(l *Limit) *uint64 { return &l.EgressBurst },
	"ingressRate":  func(l *Limit) *uint64 { return &l.IngressRate },
	"ingressBurst": func(l *Limit) *uint64 { return &l.IngressBurst },
}

// LimitFromCNI reads runtimeConfig.bandwidth as decoded from JSON: rates in
// bit/s, bursts in bits, whole non-negative numbers; unknown keys are an
// error (a typo would otherwise lift a limit). It returns nil for no limit.
func LimitFromCNI(v any) (*Limit, error) {
	m, ok := v.(map[string]any)
	if !ok {
		return nil, fmt.Errorf("bandwidth is %T, not an object", v)
	}
	var l Limit
	var keys []string
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		field, ok := cniKeys[k]
		if !ok {
			return nil, fmt.Errorf("bandwidth has an unknown key %q (ingressRate, ingressBurst, egressRate, egressBurst)", k)
		}
		n, ok := m[k].(float64)
		if !ok || n < 0 || n != math.Trunc(n) || n > math.MaxUint64/2 {
			return nil, fmt.Errorf("bandwidth %s is %v: want a whole number of bits (per second, for a rate), 0 or more", k, m[k])
		}
		*field(&l) = uint64(n)
	}
	if err := l.Validate(); err != nil {
		return nil, err
	}
	if l.None() {
		return nil, nil
	}
	return &l, nil
}

// QoS classes of containers (Limit.Class). Normal is the default.
const (
	ClassNormal = "normal"
	ClassHigh   = "high"
	ClassLow    = "low"
)

// ValidateClass checks a QoS class name ("" is normal).
func ValidateClass(c string) error {
	switch c {
	case "", ClassNormal, ClassHigh, ClassLow:
		return nil
	}
	return fmt.Errorf("QoS class %q: want high, normal or low", c)
}

// Marks reports whether l's class marks packets (high or low).
func (l Limit) Marks() bool { return l.Class == ClassHigh || l.Class == ClassLow }

// FormatRate writes bit/s as tc would: "100mbit".
func FormatRate(bps uint64) string {
	for _, u := range []struct {
		name string
		v    uint64
	}{{"tbit", 1e12}, {"gbit", 1e9}, {"mbit", 1e6}, {"kbit", 1e3}} {
		if bps >= u.v && bps%u.v == 0 {
			return strconv.FormatUint(bps/u.v, 10) + u.name
		}
	}
	return strconv.FormatUint(bps, 10) + "bit"
}
