package agent

import "testing"

func TestWithin(t *testing.T) {
	for _, c := range []struct {
		p, c string
		want bool
	}{
		{"/system.slice/skiffd.service", "/system.slice", true},
		{"/system.slice/skiffd.service", "/system.slice/skiffd.service", true},
		{"/system.slice/skiffd.service", "/", true},
		{"/system.slice/skiffd.service", "/system.slice/skiffd", false},
		{"/system.slice/skiffd.service", "/kubepods.slice", false},
		{"/", "/kubepods.slice/pod1", false},
	} {
		if got := within(c.p, c.c); got != c.want {
			t.Errorf("within(%q, %q) = %v", c.p, c.c, got)
		}
	}
}
