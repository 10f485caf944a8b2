package agent

import (
	"log/slog"
	"sync"
	"time"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/bpfmap"
)

// mapUse keeps the use of the agent's pinned maps, read again when a
// status asks and the last reading is older than mapUseAge: walking a
// full 65 536-entry map takes tens of milliseconds, and tools poll the
// status.
type mapUse struct {
	mu   sync.Mutex
	at   time.Time
	last []api.MapUse
}

const mapUseAge = 10 * time.Second

func (m *mapUse) use(dir string, log *slog.Logger) []api.MapUse {
	m.mu.Lock()
	defer m.mu.Unlock()
	if time.Since(m.at) < mapUseAge {
		return m.last
	}
	use, err := bpfmap.UseOf(dir)
	if err != nil {
		log.Warn("map use not read", "dir", dir, "err", err)
	}
	m.at, m.last = time.Now(), make([]api.MapUse, len(use))
	for i, u := range use {
		m.last[i] = api.MapUse{Name: u.Name, Type: u.Type, Entries: u.Entries, Capacity: u.Capacity}
	}
	return m.last
}
