package tc

import (
	"os"
	"os/exec"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// TestAttachMovesPriority: attaching a filter at a new priority removes
// the one of the same name an older skiff left at the old priority (it
// would run besides, in the old order), and leaves other names alone.
func TestAttachMovesPriority(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	const name = "skiff-test-tc"
	exec.Command("ip", "netns", "del", name).Run()
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	ns, err := netns.GetFromName(name)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if err := h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "v0"}, PeerName: "v1"}); err != nil {
		t.Fatal(err)
	}
	link, err := h.LinkByName("v0")
	if err != nil {
		t.Fatal(err)
	}
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SchedCLS, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()}})
	if err != nil {
		t.Fatal(err)
	}
	defer prog.Close()
	for _, a := range []struct {
		name string
		prio uint16
	}{{"old", 2}, {"other", 1}, {"old", 3}} {
		if err := Attach(h, link, Ingress, a.prio, a.name, prog); err != nil {
			t.Fatal(err)
		}
	}
	filters, err := h.FilterList(link, Ingress)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]uint16{}
	for _, f := range filters {
		if bf, ok := f.(*netlink.BpfFilter); ok {
			if p, seen := got[bf.Name]; seen && p != bf.Priority {
				t.Errorf("%s at priorities %d and %d", bf.Name, p, bf.Priority)
			}
			got[bf.Name] = bf.Priority
		}
	}
	if got["old"] != 3 || got["other"] != 1 || len(got) != 2 {
		t.Errorf("filters %v, want old at 3 alone and other at 1", got)
	}
	// A teardown: "old" goes from every device and hook, "other" stays.
	peer, err := h.LinkByName("v1")
	if err != nil {
		t.Fatal(err)
	}
	if err := Attach(h, peer, Egress, 3, "old", prog); err != nil {
		t.Fatal(err)
	}
	if err := DetachAll(h, "old"); err != nil {
		t.Fatal(err)
	}
	left := map[string]int{}
	for _, l := range []netlink.Link{link, peer} {
		for _, hook := range []uint32{Ingress, Egress} {
			fs, err := h.FilterList(l, hook)
			if err != nil {
				t.Fatal(err)
			}
			for _, f := range fs {
				if bf, ok := f.(*netlink.BpfFilter); ok {
					left[bf.Name]++
				}
			}
		}
	}
	if left["old"] != 0 || left["other"] != 1 {
		t.Errorf("after DetachAll(old): %v, want other alone", left)
	}
}
