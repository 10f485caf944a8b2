package bpfmap

import (
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
)

func TestCounterNames(t *testing.T) {
	enum := &btf.Enum{Name: "reason", Size: 4, Values: []btf.EnumValue{
		{Name: "R_SECOND", Value: 1}, {Name: "R_FIRST", Value: 0}, {Name: "R_THIRD_ONE", Value: 2}, {Name: "R_NR", Value: 3},
	}}
	names, err := CounterNames(&ebpf.MapSpec{Name: "stats", MaxEntries: 3, Key: &btf.Typedef{Name: "r", Type: enum}}, "R_")
	if err != nil || !slices.Equal(names, []string{"first", "second", "third_one"}) {
		t.Fatalf("names %q, %v", names, err)
	}
	if _, err := CounterNames(&ebpf.MapSpec{Name: "stats", MaxEntries: 5, Key: enum}, "R_"); err == nil || !strings.Contains(err.Error(), "no value 4") {
		t.Errorf("a map larger than its enum: %v", err)
	}
	if _, err := CounterNames(&ebpf.MapSpec{Name: "stats", MaxEntries: 1, Key: &btf.Int{Size: 4}}, "R_"); err == nil {
		t.Error("a key that is not an enum: no error")
	}
}
