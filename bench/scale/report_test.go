package scale

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"io"
	"strings"
	"testing"

	"github.com/skiffnet/skiff/bench"
)

func TestSpread(t *testing.T) {
	s := spreadOf([]float64{5, 1, 4, 2, 3})
	if s != (Spread{N: 5, P50: 3, P99: 4.96, Max: 5}) {
		t.Errorf("spread = %+v", s)
	}
	if s := spreadOf(nil); s.N != 0 || s.String() != "-" {
		t.Errorf("empty spread = %+v %q", s, s.String())
	}
}

func sample() *Report {
	return &Report{Schema: Schema, Commit: "0123456789abcdef", CPUs: 2,
		Burst: []BurstPoint{{N: 10, Add: Spread{N: 10, P50: 20, P99: 40, Max: 41}, Reach: Spread{N: 10, P50: 30, P99: 60, Max: 61},
			Agent: map[string]Spread{"add store": {N: 10, P50: 3, P99: 9, Max: 9}}}, {N: 50, Add: Spread{N: 50, P50: 90, P99: 200, Max: 210}}},
		Hosts: []HostsPoint{{Hosts: 2, RSSMiB: Spread{N: 2, P50: 70, Max: 71}, Reach: Spread{N: 1, P50: 80, Max: 80}}},
		Rules: []RulesPoint{{Rules: 10, ChangeMs: 150, TCPRR: &bench.Paired{Ratio: 0.97, Low: 0.9, High: 1.02}}, {Rules: 1000, ChangeMs: 300}},
		Flows: []FlowsPoint{{Flows: 1000, Opened: 1000, Echoed: 1000, Table: 1000, TableSize: 65536, SYNs: map[string]uint64{"table_open": 999, "table_no_path": 1}}},
	}
}

// The Markdown has a row per point, with the figures given.
func TestWriteMarkdown(t *testing.T) {
	var b bytes.Buffer
	if err := sample().WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Commit 0123456789ab", "| 10 | 20 / 40 / 41 | 30 / 60 / 61 | - |", "| 3 / 9 / 9 |", "| 50 | 90 / 200 / 210 | - |",
		"| 2 | 0 | 70 / 71 |", "| 10 | 0.0 | 150 |", "0.97 (0.90–1.02) | - |", "| 1000 | 1000 (0.0) | 1000 | 1000 / 65536 | 999 / 0 / 1 |"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("no %q in\n%s", want, b.String())
		}
	}
}

// The chart is well-formed SVG with a panel per part and a curve per
// series; a missing ratio leaves a gap, not a point at zero.
func TestWriteSVG(t *testing.T) {
	var b bytes.Buffer
	if err := sample().WriteSVG(&b); err != nil {
		t.Fatal(err)
	}
	d := xml.NewDecoder(&b)
	counts := map[string]int{}
	for {
		tok, err := d.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("not XML: %v", err)
		}
		if se, ok := tok.(xml.StartElement); ok {
			counts[se.Name.Local]++
		}
	}
	// curves: burst 3, hosts 2, rules 2, flows 2; points: burst 3×2,
	// hosts 2×1, rules 1 (tcp_rr at 10 rules), flows 2×1
	if counts["polyline"] != 9 || counts["circle"] != 6+2+1+2 {
		t.Errorf("elements %v", counts)
	}
}

// The JSON names its schema and round-trips.
func TestWriteJSON(t *testing.T) {
	var b bytes.Buffer
	if err := sample().WriteJSON(&b); err != nil {
		t.Fatal(err)
	}
	var back Report
	if err := json.Unmarshal(b.Bytes(), &back); err != nil {
		t.Fatal(err)
	}
	if back.Schema != Schema || len(back.Burst) != 2 || back.Rules[0].TCPRR.Ratio != 0.97 || back.Flows[0].SYNs["table_open"] != 999 {
		t.Errorf("round trip: %+v", back)
	}
}

func TestRunRefusesUnknownPart(t *testing.T) {
	if _, err := Run(t.Context(), Options{Parts: []string{"burst", "planets"}}); err == nil || !strings.Contains(err.Error(), "planets") {
		t.Errorf("err = %v", err)
	}
}

func TestFiller(t *testing.T) {
	rules := filler(1000)
	ids := map[string]bool{}
	for _, r := range rules {
		if err := r.Validate(); err != nil {
			t.Fatal(err)
		}
		if ids[r.ID] {
			t.Fatalf("id %s twice", r.ID)
		}
		ids[r.ID] = true
		if !r.Src.Addr().IsValid() || r.Src.Addr().As4()[2] < 200 {
			t.Fatalf("rule %v may match a lab host's pods", r)
		}
	}
}
