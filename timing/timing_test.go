package timing

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"
)

func TestSteps(t *testing.T) {
	var b bytes.Buffer
	log := slog.New(slog.NewTextHandler(&b, nil))
	s := Start(log, "fast", time.Hour, "container", "c1")
	s.Step("one")
	s.Done()
	if b.Len() != 0 {
		t.Errorf("a fast operation was logged: %s", b.String())
	}
	s = Start(log, "slow thing", 0, "container", "c1")
	s.Step("read store")
	s.Step("layer cache")
	s.Done()
	for _, want := range []string{`msg="slow thing"`, "container=c1", "took_ms=", "read_store_ms=", "layer_cache_ms="} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("no %q in %s", want, b.String())
		}
	}
}
