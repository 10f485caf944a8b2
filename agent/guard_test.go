package agent

import (
	"context"
	"net/netip"
	"slices"
	"testing"
)

func TestResolveEndpoint(t *testing.T) {
	for _, c := range []struct {
		in   string
		want string // "" for an error
	}{
		{"https://10.0.0.1:2379", "10.0.0.1:2379"},
		{"http://10.0.0.1", "10.0.0.1:2379"},
		{"10.0.0.1:2380", "10.0.0.1:2380"},
		{":9473", "0.0.0.0:9473"},
		{"[::]:9473", "0.0.0.0:9473"},
		{"127.0.0.1:9473", "127.0.0.1:9473"},
		{"https://10.0.0.1:port", ""},
		{"", ""},
	} {
		addrs, port, err := resolveEndpoint(context.Background(), c.in)
		if c.want == "" {
			if err == nil {
				t.Errorf("%q: %v %d, want an error", c.in, addrs, port)
			}
			continue
		}
		if err != nil || len(addrs) != 1 || netip.AddrPortFrom(addrs[0], port).String() != c.want {
			t.Errorf("%q: %v %d %v, want %s", c.in, addrs, port, err, c.want)
		}
	}
}

func TestControlPlane(t *testing.T) {
	cp, err := controlPlane(context.Background(), []string{"https://10.99.0.254:2379"}, []netip.AddrPort{netip.MustParseAddrPort("0.0.0.0:9473")})
	if err != nil {
		t.Fatal(err)
	}
	if want := []uint16{9473, 2379, 2380}; !slices.Equal(cp.Ports, want) {
		t.Errorf("ports %v, want %v", cp.Ports, want)
	}
	want := []netip.AddrPort{netip.MustParseAddrPort("10.99.0.254:2379"), netip.MustParseAddrPort("10.99.0.254:2380")}
	if !slices.Equal(cp.Endpoints, want) {
		t.Errorf("endpoints %v, want %v", cp.Endpoints, want)
	}
}
