package agent

import (
	"sync"
	"sync/atomic"
	"testing"
)

// TestKeyed: holders of one key take turns; different keys do not wait
// for each other; no lock outlives its last user.
func TestKeyed(t *testing.T) {
	var k keyed
	var inside [3]atomic.Int32
	var overlap atomic.Bool
	var wg sync.WaitGroup
	for i := range 300 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := i % 3
			unlock := k.lock(string(rune('a' + key)))
			if inside[key].Add(1) > 1 {
				overlap.Store(true)
			}
			inside[key].Add(-1)
			unlock()
		}()
	}
	wg.Wait()
	if overlap.Load() {
		t.Error("two holders of one key at once")
	}
	if n := k.held(); n != 0 {
		t.Errorf("%d locks left after every user released", n)
	}

	// b is free while a is held.
	unlockA := k.lock("a")
	got := make(chan struct{})
	go func() { k.lock("b")(); close(got) }()
	<-got
	unlockA()
}
