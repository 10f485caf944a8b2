package cluster

import (
	"strings"
	"testing"
)

func TestValidateContainerID(t *testing.T) {
	for _, tc := range []struct {
		id string
		ok bool
	}{
		{"skiff-lab-h1-c1", true},
		{strings.Repeat("0123456789abcdef", 4), true}, // containerd's 64 hex digits
		{"a", true},
		{"a.b_c-d", true},
		{strings.Repeat("a", MaxContainerIDLen), true},
		{"", false},
		{strings.Repeat("a", MaxContainerIDLen+1), false},
		{strings.Repeat("a", 1<<20), false},
		{"../x", false},
		{"a/../../x", false},
		{"..", false},
		{".", false},
		{".hidden", false},
		{"-flag", false},
		{"_x", false},
		{"a b", false},
		{"a\x00b", false},
		{"a\nb", false},
		{"ä", false},
	} {
		err := ValidateContainerID(tc.id)
		if (err == nil) != tc.ok {
			t.Errorf("ValidateContainerID(%.40q) = %v, want ok %v", tc.id, err, tc.ok)
		}
	}
}

func TestValidateIfName(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool
	}{
		{"eth0", true},
		{"net1.100", true},
		{"a", true},
		{"abcdefghijklmno", true}, // 15
		{"", false},
		{"abcdefghijklmnop", false}, // 16
		{".", false},
		{"..", false},
		{"a/b", false},
		{"../x", false},
		{"a:b", false},
		{"a b", false},
		{"a\tb", false},
	} {
		err := ValidateIfName(tc.name)
		if (err == nil) != tc.ok {
			t.Errorf("ValidateIfName(%q) = %v, want ok %v", tc.name, err, tc.ok)
		}
	}
}

func TestValidateNetns(t *testing.T) {
	for _, tc := range []struct {
		path string
		ok   bool
	}{
		{"/run/netns/x", true},
		{"/proc/1234/ns/net", true},
		{"", false},
		{"run/netns/x", false},
		{"/run/netns/../../etc/x", false},
		{"/run/netns/./x", false},
		{"/run//netns/x", false},
		{"/run/netns/x/", false},
		{"/" + strings.Repeat("a", 4096), false},
	} {
		err := ValidateNetns(tc.path)
		if (err == nil) != tc.ok {
			t.Errorf("ValidateNetns(%.40q) = %v, want ok %v", tc.path, err, tc.ok)
		}
	}
}

func TestValidateCgroup(t *testing.T) {
	for p, ok := range map[string]bool{
		"": true, "kubepods.slice:cri-containerd:abc": true, "/sys/fs/cgroup/unified/skiff/c1": true, "skiff/c1": true,
		"/": false, ".": false, "//": false, "-.slice": false, "-.slice:x:y": false, "a/../..": false, "../x": false,
		"x/..": false, "system.slice:..:x": false, "a\x00b": false,
	} {
		if err := ValidateCgroup(p); (err == nil) != ok {
			t.Errorf("ValidateCgroup(%q) = %v, want ok %v", p, err, ok)
		}
	}
}
