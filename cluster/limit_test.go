package cluster

import (
	"encoding/json"
	"strings"
	"testing"
)

func cni(t *testing.T, s string) any {
	t.Helper()
	var v any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		t.Fatal(err)
	}
	return v
}

// TestFromCNI: runtimeConfig.bandwidth as runtimes pass it, good and bad.
func TestLimitFromCNI(t *testing.T) {
	for _, tc := range []struct {
		name, json string
		want       *Limit
		err        string
	}{
		{"egress only", `{"egressRate":100000000,"egressBurst":1000000}`, &Limit{EgressRate: 1e8, EgressBurst: 1e6}, ""},
		{"both", `{"ingressRate":1e9,"ingressBurst":8e6,"egressRate":1e7,"egressBurst":80000}`,
			&Limit{IngressRate: 1e9, IngressBurst: 8e6, EgressRate: 1e7, EgressBurst: 80000}, ""},
		{"kubelet's unset burst", `{"ingressRate":10000000,"ingressBurst":2147483647}`, &Limit{IngressRate: 1e7, IngressBurst: 2147483647}, ""},
		{"nothing", `{}`, nil, ""},
		{"zeros", `{"egressRate":0,"egressBurst":0}`, nil, ""},
		{"negative", `{"egressRate":-5,"egressBurst":1000}`, nil, "egressRate is -5"},
		{"fraction", `{"egressRate":1000.5,"egressBurst":1000}`, nil, "whole number"},
		{"string", `{"egressRate":"100mbit","egressBurst":1000}`, nil, "egressRate is 100mbit"},
		{"burst without rate", `{"ingressBurst":1000}`, nil, "ingress burst 1000 bits without a rate"},
		{"rate without burst", `{"ingressRate":1000000}`, nil, "ingress rate 1mbit without a burst"},
		{"too slow", `{"egressRate":100,"egressBurst":1000}`, nil, "below 8kbit"},
		{"absurd rate", `{"egressRate":1e15,"egressBurst":1000}`, nil, "above 1tbit"},
		{"absurd burst", `{"egressRate":1e6,"egressBurst":1e12}`, nil, "burst 1000000000000 bits is above"},
		{"unknown key", `{"egressrate":1e6,"egressBurst":1000}`, nil, `unknown key "egressrate"`},
		{"not an object", `[1,2]`, nil, "not an object"},
	} {
		got, err := LimitFromCNI(cni(t, tc.json))
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%s: %v, want an error with %q", tc.name, err, tc.err)
			}
			continue
		}
		if err != nil || (got == nil) != (tc.want == nil) || got != nil && *got != *tc.want {
			t.Errorf("%s: %+v %v, want %+v", tc.name, got, err, tc.want)
		}
	}
}

func TestFormatRate(t *testing.T) {
	for bps, want := range map[uint64]string{1e8: "100mbit", 15e8: "1500mbit", 8000: "8kbit", 1234: "1234bit", 2e12: "2tbit"} {
		if got := FormatRate(bps); got != want {
			t.Errorf("FormatRate(%d) = %s, want %s", bps, got, want)
		}
	}
}

// TestClamp: bursts within what the data path uses; kubelet's 2^31-1 bits
// becomes one second at the rate; a tiny one two GSO segments.
func TestClamp(t *testing.T) {
	got := Limit{EgressRate: 1e7, EgressBurst: 2147483647, IngressRate: 1e9, IngressBurst: 1000}.Clamp()
	want := Limit{EgressRate: 1e7, EgressBurst: 1e7, IngressRate: 1e9, IngressBurst: MinBurst}
	if got != want {
		t.Errorf("Clamp = %+v, want %+v", got, want)
	}
	if got := (Limit{EgressRate: 8000, EgressBurst: 5e6}).Clamp(); got.EgressBurst != MinBurst {
		t.Errorf("slow rate: burst %d, want %d", got.EgressBurst, MinBurst)
	}
}

// TestUnits: rates and sizes as tc writes them, and what is not one.
func TestUnits(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want uint64
		err  string
	}{
		{"100mbit", 1e8, ""}, {"1Gbit", 1e9, ""}, {"12.5mbps", 1e8, ""}, {"8000", 8000, ""},
		{"none", 0, ""}, {"0", 0, ""}, {"10mbits", 0, "unknown unit"}, {"-5mbit", 0, "0 or more"},
		{"fast", 0, "unknown unit"}, {"mbit", 0, "want a number"}, {"1e30tbit", 0, "too large"},
	} {
		got, err := ParseRate(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParseRate(%q) = %d, %v; want an error with %q", tc.in, got, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("ParseRate(%q) = %d, %v; want %d", tc.in, got, err, tc.want)
		}
	}
	for in, want := range map[string]uint64{"64kb": 64 << 13, "1mb": 8 << 20, "1500": 12000, "800kbit": 800 << 10} {
		if got, err := ParseSize(in); err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	if _, err := ParseSize("none"); err == nil {
		t.Error(`ParseSize("none") is not an error`)
	}
	if got := (Limit{EgressRate: 1e8, EgressBurst: 8 << 20}).String(); got != "egress 100mbit burst 1mb" {
		t.Errorf("String = %q", got)
	}
	if got := DefaultBurst(1e9); got != 1e7 {
		t.Errorf("DefaultBurst(1gbit) = %d", got)
	}
}
