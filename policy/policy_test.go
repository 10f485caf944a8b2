package policy

import (
	"net/netip"
	"strings"
	"testing"
)

func TestAllowedFirstMatchWins(t *testing.T) {
	set, err := NewSet([]Rule{
		{ID: "deny-web", Priority: 20, Action: Deny, Dst: netip.MustParsePrefix("10.244.2.0/24"), Proto: TCP, Port: 80},
		{ID: "allow-probe", Priority: 10, Action: Allow, Src: netip.MustParsePrefix("10.244.1.7/32")},
		{ID: "deny-icmp", Priority: 30, Action: Deny, Proto: ICMP},
		{ID: "deny-range", Priority: 40, Action: Deny, Proto: UDP, Port: 5000, PortEnd: 5010},
	})
	if err != nil {
		t.Fatal(err)
	}
	a := netip.MustParseAddr
	for _, tc := range []struct {
		name string
		flow Flow
		want bool
	}{
		{"denied port", Flow{a("10.244.1.5"), a("10.244.2.3"), TCP, 80}, false},
		{"other port", Flow{a("10.244.1.5"), a("10.244.2.3"), TCP, 81}, true},
		{"udp same port", Flow{a("10.244.1.5"), a("10.244.2.3"), UDP, 80}, true},
		{"earlier allow wins", Flow{a("10.244.1.7"), a("10.244.2.3"), TCP, 80}, true},
		{"icmp denied", Flow{a("10.244.1.5"), a("10.244.3.3"), ICMP, 0}, false},
		{"default allow", Flow{a("10.244.1.5"), a("10.244.3.3"), UDP, 53}, true},
		{"range's first port", Flow{a("10.244.1.5"), a("10.244.3.3"), UDP, 5000}, false},
		{"range's last port", Flow{a("10.244.1.5"), a("10.244.3.3"), UDP, 5010}, false},
		{"past the range", Flow{a("10.244.1.5"), a("10.244.3.3"), UDP, 5011}, true},
		{"before the range", Flow{a("10.244.1.5"), a("10.244.3.3"), UDP, 4999}, true},
	} {
		if got := set.Allowed(tc.flow); got != tc.want {
			t.Errorf("%s: Allowed = %v, want %v", tc.name, got, tc.want)
		}
	}
	if set[0].ID != "allow-probe" || set[2].ID != "deny-icmp" {
		t.Errorf("order = %v", set)
	}
}

func TestParseRule(t *testing.T) {
	r, err := ParseRule(strings.Fields("web deny priority 5 from 10.244.1.5 to 10.244.2.0/24 proto tcp port 8080"))
	if err != nil {
		t.Fatal(err)
	}
	want := Rule{ID: "web", Action: Deny, Priority: 5, Src: netip.MustParsePrefix("10.244.1.5/32"),
		Dst: netip.MustParsePrefix("10.244.2.0/24"), Proto: TCP, Port: 8080}
	if r != want {
		t.Fatalf("got %+v, want %+v", r, want)
	}
	again, err := ParseRule(strings.Fields(r.String()))
	if err != nil || again != r {
		t.Fatalf("round trip of %q: %+v, %v", r.String(), again, err)
	}
	r, err = ParseRule(strings.Fields("nodeports allow proto tcp port 30000-32767"))
	if err != nil || r.Port != 30000 || r.PortEnd != 32767 || r.LastPort() != 32767 {
		t.Fatalf("range: %+v, %v", r, err)
	}
	if again, err := ParseRule(strings.Fields(r.String())); err != nil || again != r {
		t.Fatalf("round trip of %q: %+v, %v", r.String(), again, err)
	}
}

func TestParseRuleErrors(t *testing.T) {
	for _, in := range []string{
		"",
		"x",
		"x permit",
		"X allow",
		"x allow port 80",
		"x allow proto sctp",
		"x allow proto tcp port 70000",
		"x allow proto tcp port 0",
		"x allow proto tcp port 80-80",
		"x allow proto tcp port 90-80",
		"x allow proto tcp port 80-",
		"x allow proto tcp port 80-70000",
		"x allow from 10.244.1.1/24",
		"x allow from fd00::/64",
		"x allow to",
		"x allow colour blue",
	} {
		if _, err := ParseRule(strings.Fields(in)); err == nil {
			t.Errorf("ParseRule(%q) succeeded", in)
		}
	}
}
