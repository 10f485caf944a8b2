package agent

import "sync"

// keyed is a lock per key: an endpoint's (container ID/interface), so
// that ADD, CHECK and DEL of one endpoint take turns while those of
// different endpoints run at once. A key's lock exists while someone
// holds or waits for it.
type keyed struct {
	mu    sync.Mutex
	locks map[string]*keyLock
}

type keyLock struct {
	sync.Mutex
	users int // holding or waiting
}

// lock takes key's lock and returns its release.
func (k *keyed) lock(key string) (unlock func()) {
	k.mu.Lock()
	if k.locks == nil {
		k.locks = map[string]*keyLock{}
	}
	l := k.locks[key]
	if l == nil {
		l = &keyLock{}
		k.locks[key] = l
	}
	l.users++
	k.mu.Unlock()
	l.Lock()
	return func() {
		l.Unlock()
		k.mu.Lock()
		if l.users--; l.users == 0 {
			delete(k.locks, key)
		}
		k.mu.Unlock()
	}
}

// held is how many keys are held or waited for (tests).
func (k *keyed) held() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.locks)
}
