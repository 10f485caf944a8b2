package scale_test

import (
	"bytes"
	"os"
	"testing"

	"github.com/skiffnet/skiff/bench/scale"
	"github.com/skiffnet/skiff/lab/labtest"
)

// TestScaleOnLab runs every part at its smallest sizes (skiff bench
// --scale --scale-small) on real labs: each measures what it says, and
// every pod, flow and host it made worked. Not judged on speed.
func TestScaleOnLab(t *testing.T) {
	if testing.Short() || os.Geteuid() != 0 {
		t.Skip("needs root and the lab")
	}
	opts := scale.Small
	opts.BinDir = labtest.BinDir(t, "skiffd")
	var progress bytes.Buffer
	opts.Progress = &progress
	r, err := scale.Run(t.Context(), opts)
	t.Log(progress.String())
	if err != nil {
		t.Fatal(err)
	}
	var md bytes.Buffer
	r.WriteMarkdown(&md)
	t.Log(md.String())
	for _, p := range r.Burst {
		if p.Failed != 0 || p.Add.N != p.N || p.Reach.N != p.N || p.Del.N != p.N || p.Agent["add took"].N != p.N {
			t.Errorf("burst %+v", p)
		}
	}
	for _, p := range r.Hosts {
		if p.Reach.N != p.Hosts || p.RSSMiB.N != p.Hosts || p.WritesPerAdd < 1 || p.StoreKeys < 1 || p.RSSMiB.P50 <= 0 {
			t.Errorf("hosts %+v", p)
		}
	}
	for _, p := range r.Rules {
		if p.ChangeMs <= 0 || p.Add.N != 5 || p.TCPRR == nil || p.TCPCRR == nil {
			t.Errorf("rules %+v", p)
		}
	}
	for _, p := range r.Flows {
		// every connection works; every first packet opened a table
		// entry but those sent before the cache learnt the path from
		// the first (up to the 64 dialers in flight then)
		open, noPath := p.SYNs["table_open"], p.SYNs["table_no_path"]
		if p.Opened != p.Flows || p.Echoed != p.Flows || open+noPath != uint64(p.Flows) || len(p.SYNs) > 2 || noPath > 64 ||
			p.Table < int(open) || p.NewSYNs["table_open"] != 100 || p.TableSize < p.Flows {
			t.Errorf("flows %+v", p)
		}
	}
	if len(r.Burst) != len(opts.Bursts) || len(r.Hosts) != len(opts.Hosts) || len(r.Rules) != len(opts.Rules) || len(r.Flows) != len(opts.Flows) {
		t.Errorf("points missing: %+v", r)
	}
}
