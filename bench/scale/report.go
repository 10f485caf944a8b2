package scale

import (
	"encoding/json"
	"fmt"
	"html"
	"io"
	"math"
	"strings"

	"github.com/skiffnet/skiff/bench"
)

// WriteJSON writes the report as indented JSON (schema skiff-scale/v1).
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

func (s Spread) String() string {
	if s.N == 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f / %.0f / %.0f", s.P50, s.P99, s.Max)
}

// WriteMarkdown writes a table per part measured.
func (r *Report) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "Commit %s, %s, Linux %s, %d CPUs; the run took %.0f s.\n", short(r.Commit), r.Date, r.Kernel, r.CPUs, r.Seconds)
	if len(r.Burst) > 0 {
		b.WriteString("\n**Pod burst** (N ADDs at once on one host, auto; ms, p50 / p99 / max)\n\n")
		b.WriteString("| pods | ADD | reaches another host | of which after the ADD | DEL | agent: ADD | wait | store | overlay | layers | DEL | CPU per pod (ms): all / agent | failed |\n")
		b.WriteString("|---:|---|---|---|---|---|---|---|---|---|---|---|---:|\n")
		for _, p := range r.Burst {
			a := p.Agent
			fmt.Fprintf(&b, "| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %.0f / %.0f | %d |\n", p.N, p.Add, p.Reach, p.ReachAfterAdd, p.Del,
				a["add took"], a["add wait"], a["add store"], a["add overlay"], a["add layers"], a["del took"], p.CPUMs, p.AgentCPUMs, p.Failed)
		}
	}
	if len(r.Hosts) > 0 {
		b.WriteString("\n**Hosts** (2 pods each, every agent on this machine)\n\n")
		b.WriteString("| hosts | lab up (s) | agent RSS p50 / max (MiB) | idle CPU p50 / max (% of a core) | store keys | store writes per ADD | reconciles per ADD | new host: agent ready (ms) | its pod's ADD (ms) | reached by all others p50 / max (ms) |\n")
		b.WriteString("|---:|---:|---|---|---:|---:|---:|---:|---:|---|\n")
		for _, p := range r.Hosts {
			fmt.Fprintf(&b, "| %d | %.0f | %.0f / %.0f | %.2f / %.2f | %d | %d | %.1f | %.0f | %.0f | %.0f / %.0f |\n", p.Hosts, p.UpSeconds,
				p.RSSMiB.P50, p.RSSMiB.Max, p.IdleCPU.P50, p.IdleCPU.Max, p.StoreKeys, p.WritesPerAdd, p.ReconcilesPerAdd,
				p.JoinReadyMs, p.JoinAddMs, p.Reach.P50, p.Reach.Max)
		}
	}
	if len(r.Rules) > 0 {
		b.WriteString("\n**Policy rules** (2 hosts, auto)\n\n")
		b.WriteString("| rules | written in (s) | one change applied on both hosts (ms) | ADD p50 / p99 / max (ms) | tcp_rr auto/host | tcp_crr auto/host |\n")
		b.WriteString("|---:|---:|---:|---|---|---|\n")
		for _, p := range r.Rules {
			fmt.Fprintf(&b, "| %d | %.1f | %.0f | %s | %s | %s |\n", p.Rules, p.PutSeconds, p.ChangeMs, p.Add, paired(p.TCPRR), paired(p.TCPCRR))
		}
	}
	if len(r.Flows) > 0 {
		b.WriteString("\n**Concurrent flows** (TCP connections open at once between two pods of two hosts, auto)\n\n")
		b.WriteString("| flows | opened (s) | echoed after | connection table (entries / size) | first packets: table / full / other | 100 new: table / full / other | conntrack | agent RSS (MiB) |\n")
		b.WriteString("|---:|---|---:|---|---|---|---:|---:|\n")
		for _, p := range r.Flows {
			fmt.Fprintf(&b, "| %d | %d (%.1f) | %d | %d / %d | %s | %s | %d | %.0f |\n", p.Flows, p.Opened, p.OpenSeconds, p.Echoed,
				p.Table, p.TableSize, outcomes(p.SYNs), outcomes(p.NewSYNs), p.Conntrack, p.AgentRSSMiB)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// paired is a paired ratio and its interval.
func paired(p *bench.Paired) string {
	if p == nil {
		return "-"
	}
	return fmt.Sprintf("%.2f (%.2f–%.2f)", p.Ratio, p.Low, p.High)
}

// outcomes is first packets that opened a table entry, found it full, and
// the rest.
func outcomes(m map[string]uint64) string {
	var other uint64
	for k, v := range m {
		if k != "table_open" && k != "table_full" {
			other += v
		}
	}
	return fmt.Sprintf("%d / %d / %d", m["table_open"], m["table_full"], other)
}

func short(commit string) string {
	if len(commit) > 12 {
		return commit[:12]
	}
	return commit
}

// series is one curve of a chart.
type series struct {
	name string
	ys   []float64
}

// chart is one panel: curves over a log x axis.
type chart struct {
	title, unit string
	xs          []float64
	curves      []series
}

// WriteSVG draws a panel of curves per part measured.
func (r *Report) WriteSVG(w io.Writer) error {
	var charts []chart
	if len(r.Burst) > 0 {
		c := chart{title: "Pod burst on one host", unit: "ms (p99)"}
		var add, reach, del []float64
		for _, p := range r.Burst {
			c.xs = append(c.xs, float64(p.N))
			add, reach, del = append(add, p.Add.P99), append(reach, p.Reach.P99), append(del, p.Del.P99)
		}
		c.curves = []series{{"ADD", add}, {"reaches another host", reach}, {"DEL", del}}
		charts = append(charts, c)
	}
	if len(r.Hosts) > 0 {
		c := chart{title: "New host reached by all others", unit: "ms"}
		var ready, all []float64
		for _, p := range r.Hosts {
			c.xs = append(c.xs, float64(p.Hosts))
			ready, all = append(ready, p.JoinReadyMs), append(all, p.Reach.Max)
		}
		c.curves = []series{{"agent start to ready", ready}, {"ready to reached by all", all}}
		charts = append(charts, c)
	}
	if len(r.Rules) > 0 {
		c := chart{title: "Policy rules", unit: "auto / host"}
		var rr, crr []float64
		for _, p := range r.Rules {
			c.xs = append(c.xs, float64(p.Rules))
			rr, crr = append(rr, value(p.TCPRR)), append(crr, value(p.TCPCRR))
		}
		c.curves = []series{{"tcp_rr", rr}, {"tcp_crr", crr}}
		charts = append(charts, c)
	}
	if len(r.Flows) > 0 {
		c := chart{title: "Concurrent flows", unit: "share of the flows"}
		var table, echoed []float64
		for _, p := range r.Flows {
			c.xs = append(c.xs, float64(p.Flows))
			table = append(table, float64(p.SYNs["table_open"])/float64(max(p.Flows, 1)))
			echoed = append(echoed, float64(p.Echoed)/float64(max(p.Flows, 1)))
		}
		c.curves = []series{{"on the connection table", table}, {"echoed", echoed}}
		charts = append(charts, c)
	}
	const pw, ph = 420, 260
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">`+"\n", 2*pw, ph*((len(charts)+1)/2))
	for i, c := range charts {
		c.draw(&b, float64(i%2*pw), float64(i/2*ph), pw, ph)
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

func value(p *bench.Paired) float64 {
	if p == nil {
		return math.NaN()
	}
	return p.Ratio
}

var colours = []string{"#1f77b4", "#d62728", "#2ca02c"}

func (c chart) draw(b *strings.Builder, x0, y0 float64, w, h int) {
	const left, right, top, bottom = 55.0, 15.0, 25.0, 60.0
	pw, ph := float64(w)-left-right, float64(h)-top-bottom
	ymax := 0.0
	for _, s := range c.curves {
		for _, y := range s.ys {
			if !math.IsNaN(y) {
				ymax = math.Max(ymax, y)
			}
		}
	}
	if ymax == 0 {
		ymax = 1
	}
	ymax *= 1.1
	lx0, lx1 := math.Log10(c.xs[0]), math.Log10(c.xs[len(c.xs)-1])
	if lx1 == lx0 {
		lx0, lx1 = lx0-1, lx1+1
	}
	px := func(x float64) float64 { return x0 + left + (math.Log10(x)-lx0)/(lx1-lx0)*pw }
	py := func(y float64) float64 { return y0 + top + ph - y/ymax*ph }
	fmt.Fprintf(b, `<text x="%.0f" y="%.0f" font-weight="bold">%s</text>`+"\n", x0+left, y0+15, html.EscapeString(c.title))
	fmt.Fprintf(b, `<line x1="%.0f" y1="%.0f" x2="%.0f" y2="%.0f" stroke="#000"/>`+"\n", x0+left, py(0), x0+left+pw, py(0))
	fmt.Fprintf(b, `<line x1="%.0f" y1="%.0f" x2="%.0f" y2="%.0f" stroke="#000"/>`+"\n", x0+left, py(0), x0+left, y0+top)
	for i := 0; i <= 4; i++ {
		y := ymax / 1.1 * float64(i) / 4
		fmt.Fprintf(b, `<text x="%.0f" y="%.0f" text-anchor="end">%s</text>`+"\n", x0+left-4, py(y)+4, tick(y))
	}
	fmt.Fprintf(b, `<text x="%.0f" y="%.0f" transform="rotate(-90 %.0f %.0f)" text-anchor="middle">%s</text>`+"\n",
		x0+12, y0+top+ph/2, x0+12, y0+top+ph/2, html.EscapeString(c.unit))
	for _, x := range c.xs {
		fmt.Fprintf(b, `<text x="%.0f" y="%.0f" text-anchor="middle">%s</text>`+"\n", px(x), py(0)+14, tick(x))
	}
	for i, s := range c.curves {
		colour := colours[i%len(colours)]
		var pts []string
		for j, y := range s.ys {
			if math.IsNaN(y) {
				continue
			}
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", px(c.xs[j]), py(y)))
			fmt.Fprintf(b, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>`+"\n", px(c.xs[j]), py(y), colour)
		}
		fmt.Fprintf(b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="2"/>`+"\n", strings.Join(pts, " "), colour)
		ly := py(0) + 30 + float64(i%2)*13
		lx := x0 + left + float64(i/2)*pw/2
		fmt.Fprintf(b, `<rect x="%.0f" y="%.0f" width="10" height="3" fill="%s"/><text x="%.0f" y="%.0f">%s</text>`+"\n",
			lx, ly-4, colour, lx+14, ly, html.EscapeString(s.name))
	}
}

func tick(v float64) string {
	switch {
	case v >= 10000:
		return fmt.Sprintf("%.0fk", v/1000)
	case v >= 10 || v == 0:
		return fmt.Sprintf("%.0f", v)
	default:
		return fmt.Sprintf("%.2g", v)
	}
}
