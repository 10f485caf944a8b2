package bench

import (
	"encoding/xml"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
)

// Chart geometry, in SVG user units (pixels).
const (
	svgLeft     = 70  // room for the y axis labels
	svgRight    = 90  // room for the "host = 1.0" label
	svgTop      = 80  // title and legend
	svgBottom   = 90  // group labels and the machine line
	svgPlotH    = 280 // height of the plot area
	svgBarW     = 28
	svgBarGap   = 4
	svgMinSlot  = 120 // minimum width of one workload group, gap included
	svgGroupPad = 36
)

var svgPalette = []string{"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"}

const svgHostColor = "#9e9e9e"

// svgChart holds the computed layout of the chart.
type svgChart struct {
	r      *Report
	groups [][]Result // per workload: primary metric rows, one per mode
	slot   float64    // width of one group
	width  float64
	height float64
	yMax   float64
	step   float64
}

// WriteSVG writes a grouped bar chart: one group per workload (its primary
// metric), one bar per mode, bar height = ratio to host as the table gives
// it (the paired median with its 95 % interval as a whisker where there are
// enough repetitions, the ratio of medians otherwise), with the host = 1.0
// line, value labels, direction of "better" and a legend.
func (r *Report) WriteSVG(w io.Writer) error {
	c := newSVGChart(r)
	var b strings.Builder
	c.write(&b)
	if _, err := io.WriteString(w, b.String()); err != nil {
		return fmt.Errorf("write SVG chart: %w", err)
	}
	return nil
}

func newSVGChart(r *Report) *svgChart {
	c := &svgChart{r: r, groups: r.primaryResults()}
	n := max(len(r.Config.Modes), 1)
	groupW := float64(n*svgBarW + (n-1)*svgBarGap)
	c.slot = math.Max(svgMinSlot, groupW+svgGroupPad)
	c.width = svgLeft + svgRight + c.slot*float64(max(len(c.groups), 1))
	c.width = math.Max(c.width, 560)
	c.height = svgTop + svgPlotH + svgBottom
	c.yMax, c.step = axisScale(c.maxRatio())
	return c
}

func (c *svgChart) maxRatio() float64 {
	m := 1.0
	for _, g := range c.groups {
		for _, res := range g {
			if res.Paired != nil {
				m = math.Max(m, res.Paired.High)
			} else if res.RatioToHost != nil {
				m = math.Max(m, *res.RatioToHost)
			}
		}
	}
	return m
}

// axisScale picks the top of the y axis (≥ 1.2 and 10% above the highest
// bar) and a tick step giving at most 8 ticks.
func axisScale(maxRatio float64) (top, step float64) {
	want := math.Max(1.2, maxRatio*1.1)
	for _, s := range []float64{0.1, 0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 250, 500, 1000} {
		step = s
		if want/s <= 8 {
			break
		}
	}
	return math.Ceil(want/step) * step, step
}

// y maps a ratio to a vertical position.
func (c *svgChart) y(ratio float64) float64 {
	return svgTop + svgPlotH - ratio/c.yMax*svgPlotH
}

func (c *svgChart) write(b *strings.Builder) {
	fmt.Fprintf(b, `<?xml version="1.0" encoding="UTF-8"?>`+"\n")
	fmt.Fprintf(b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" viewBox="0 0 %.0f %.0f" font-family="sans-serif" font-size="12">`+"\n",
		c.width, c.height, c.width, c.height)
	fmt.Fprintf(b, `<rect x="0" y="0" width="%.0f" height="%.0f" fill="white"/>`+"\n", c.width, c.height)
	text(b, svgLeft, 24, "start", `font-size="16" font-weight="bold"`, "skiff bench: each mode relative to host (host = 1.0)")
	c.legend(b)
	c.axis(b)
	if len(c.groups) == 0 || !slices.Contains(c.r.Config.Modes, HostMode) {
		text(b, c.width/2, svgTop+svgPlotH/2, "middle", `fill="#b00"`, "no host baseline or no result: nothing to compare")
	}
	for i, g := range c.groups {
		c.group(b, i, g)
	}
	c.hostLine(b)
	text(b, svgLeft, c.height-12, "start", `font-size="10" fill="#555"`, c.r.machineLine())
	b.WriteString("</svg>\n")
}

func (c *svgChart) legend(b *strings.Builder) {
	x := float64(svgLeft)
	for i, m := range c.r.Config.Modes {
		fmt.Fprintf(b, `<rect x="%.1f" y="40" width="12" height="12" fill="%s"/>`+"\n", x, c.color(i, m))
		text(b, x+16, 50, "start", "", m)
		x += 16 + float64(len(m))*7 + 20
	}
	text(b, x+10, 50, "start", `fill="#555"`, "↑ higher is better · ↓ lower is better (per workload)")
}

func (c *svgChart) axis(b *strings.Builder) {
	right := c.width - svgRight
	for v := 0.0; v <= c.yMax+1e-9; v += c.step {
		y := c.y(v)
		fmt.Fprintf(b, `<line x1="%d" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#e0e0e0"/>`+"\n", svgLeft, y, right, y)
		text(b, svgLeft-6, y+4, "end", `fill="#555"`, fmt.Sprintf("%.2f×", v))
	}
	fmt.Fprintf(b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#333"/>`+"\n", svgLeft, svgTop, svgLeft, svgTop+svgPlotH)
	fmt.Fprintf(b, `<line x1="%d" y1="%d" x2="%.1f" y2="%d" stroke="#333"/>`+"\n", svgLeft, svgTop+svgPlotH, right, svgTop+svgPlotH)
}

func (c *svgChart) hostLine(b *strings.Builder) {
	y := c.y(1)
	right := c.width - svgRight
	fmt.Fprintf(b, `<line x1="%d" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#222" stroke-width="1.5" stroke-dasharray="6 4"/>`+"\n",
		svgLeft, y, right, y)
	text(b, right+6, y+4, "start", `font-weight="bold"`, "host = 1.0")
}

// group draws one workload: a bar per mode and the labels below.
func (c *svgChart) group(b *strings.Builder, i int, rows []Result) {
	n := len(c.r.Config.Modes)
	groupW := float64(n*svgBarW + (n-1)*svgBarGap)
	x0 := svgLeft + c.slot*float64(i) + (c.slot-groupW)/2
	for j, mode := range c.r.Config.Modes {
		x := x0 + float64(j*(svgBarW+svgBarGap))
		res, ok := findMode(rows, mode)
		c.bar(b, x, j, res, ok)
	}
	mid := x0 + groupW/2
	first := rows[0]
	arrow := "↑"
	if first.Better == LowerIsBetter {
		arrow = "↓"
	}
	text(b, mid, svgTop+svgPlotH+18, "middle", `font-weight="bold"`, first.Workload)
	text(b, mid, svgTop+svgPlotH+33, "middle", `font-size="11" fill="#444"`,
		fmt.Sprintf("%s %s better", first.Metric, arrow))
}

func (c *svgChart) bar(b *strings.Builder, x float64, j int, res Result, ok bool) {
	base := c.y(0)
	if !ok || res.RatioToHost == nil {
		text(b, x+svgBarW/2, base-4, "middle", `font-size="10" fill="#b00"`, "n/a")
		return
	}
	q := *res.RatioToHost
	tip := fmt.Sprintf("%s %s, %s: median %s %s = %.2f× host's", res.Workload, res.Metric, res.Mode,
		formatValue(*res.Median), res.Unit, q)
	label := c.y(q) - 4
	if p := res.Paired; p != nil {
		q = p.Ratio
		tip += fmt.Sprintf("; paired median over repetitions %.2f× (95 %% interval %.2f–%.2f)", p.Ratio, p.Low, p.High)
		label = c.y(p.High) - 4
	}
	top := c.y(q)
	fmt.Fprintf(b, `<rect x="%.1f" y="%.1f" width="%d" height="%.1f" fill="%s"><title>%s</title></rect>`+"\n",
		x, top, svgBarW, base-top, c.color(j, res.Mode), esc(tip))
	if p := res.Paired; p != nil {
		mid, lo, hi := x+svgBarW/2, c.y(p.Low), c.y(p.High)
		fmt.Fprintf(b, `<path d="M%.1f %.1fV%.1fM%.1f %.1fh8M%.1f %.1fh8" stroke="#222" fill="none"/>`+"\n",
			mid, lo, hi, mid-4, lo, mid-4, hi)
	}
	text(b, x+svgBarW/2, label, "middle", `font-size="10"`, fmt.Sprintf("%.2f", q))
}

func (c *svgChart) color(i int, mode string) string {
	if mode == HostMode {
		return svgHostColor
	}
	return svgPalette[i%len(svgPalette)]
}

func findMode(rows []Result, mode string) (Result, bool) {
	for _, r := range rows {
		if r.Mode == mode {
			return r, true
		}
	}
	return Result{}, false
}

// text writes an SVG text element; attrs are extra raw attributes.
func text(b *strings.Builder, x, y float64, anchor, attrs, s string) {
	fmt.Fprintf(b, `<text x="%.1f" y="%.1f" text-anchor="%s" %s>%s</text>`+"\n", x, y, anchor, attrs, esc(s))
}

func esc(s string) string {
	var b strings.Builder
	_ = xml.EscapeText(&b, []byte(s)) // writing to a strings.Builder cannot fail
	return b.String()
}
