package limits

import (
	"net"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/skiffnet/skiff/bpffs/bpffstest"
	"github.com/skiffnet/skiff/tc/tctest"
)

// TestPolice: skr_police passes a device's packets while its bucket holds
// their bytes and drops the rest (TC_ACT_SHOT), refills at the rate (a
// bucket idle a second is full again), counts both, and leaves a device
// without a policer alone. BPF_PROG_RUN runs on lo (ifindex 1).
func TestPolice(t *testing.T) {
	var objs skrObjects
	if err := loadSkrObjects(&objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: bpffstest.Dir(t)}}); err != nil {
		t.Fatalf("%+v", err)
	}
	defer objs.Close()
	p := &Police{objs: objs}
	mac := net.HardwareAddr{2, 0, 0, 0, 0, 1}
	packet := tctest.Eth(mac, mac, 0x0800, make([]byte, 1000-14)) // 1000 bytes
	const unspec, shot = 0xffffffff, 2
	if got, _ := tctest.Run(t, objs.SkrPolice, packet); got != unspec {
		t.Fatalf("no policer: %#x, want TC_ACT_UNSPEC", got)
	}
	// 100 kB/s, a 3000-byte bucket: three packets pass at once.
	if err := objs.SkrPolicers.Put(uint32(1), skrSkrPolicer{Rate: 100_000, Burst: 3000}); err != nil {
		t.Fatal(err)
	}
	var verdicts []uint32
	for range 5 {
		got, _ := tctest.Run(t, objs.SkrPolice, packet)
		verdicts = append(verdicts, got)
	}
	if verdicts[0] != unspec || verdicts[1] != unspec || verdicts[2] != unspec || verdicts[3] != shot {
		t.Errorf("a burst of 5 packets of 1000 bytes through 3000: %#x, want 3 passed then dropped", verdicts)
	}
	// 10 ms at 100 kB/s: 1000 bytes, one packet. Refilled for as long
	// as the test really slept (a loaded machine oversleeps): at least one
	// packet passes, and no more than the time refilled, then one drops.
	emptied := time.Now()
	time.Sleep(12 * time.Millisecond)
	passed := 0
	for passed < 100 {
		got, _ := tctest.Run(t, objs.SkrPolice, packet)
		if got == shot {
			break
		}
		passed++
	}
	refilled := int(time.Since(emptied)/(10*time.Millisecond)) + 1
	if passed < 1 || passed > refilled {
		t.Errorf("after at least 12 ms at 100 kB/s, %d packets passed before a drop, want 1 to %d", passed, refilled)
	}
	c, err := p.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c["passed"] < 4 || c["dropped"] < 2 {
		t.Errorf("counters %v", c)
	}
	if err := p.Forget(1); err != nil {
		t.Fatal(err)
	}
	if got, _ := tctest.Run(t, objs.SkrPolice, packet); got != unspec {
		t.Errorf("after Forget: %#x, want TC_ACT_UNSPEC", got)
	}
}
