package channels

import (
	"testing"

	"github.com/skiffnet/skiff/layer/layertest"
)

// TestStatusMetrics: the channels layer's counters and map size, as
// Prometheus reads them.
func TestStatusMetrics(t *testing.T) {
	r := (&Status{Counters: map[string]uint64{"redirected": 7, "added": 4}, Sockets: 2}).report()
	text := layertest.Text(t, r.Metrics)
	if got := layertest.Value(t, text, "skiff_channels_events_total", map[string]string{"event": "redirected"}); got != 7 {
		t.Errorf("redirected: %v", got)
	}
	if got := layertest.Value(t, text, "skiff_channels_sockets", nil); got != 2 {
		t.Errorf("sockets: %v", got)
	}
}
