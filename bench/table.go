package bench

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"text/tabwriter"
)

// grid is the report laid out as a table, shared by the text and Markdown forms.
type grid struct {
	Header []string
	Rows   [][]string
}

// column is one table column: a mode's values or its ratio to host.
type column struct {
	Mode  string
	Ratio bool
}

func (r *Report) columns() []column {
	hasHost := slices.Contains(r.Config.Modes, HostMode)
	var cols []column
	for _, m := range r.Config.Modes {
		cols = append(cols, column{Mode: m})
		if hasHost && m != HostMode {
			cols = append(cols, column{Mode: m, Ratio: true})
		}
	}
	return cols
}

func (r *Report) grid() grid {
	cols := r.columns()
	g := grid{Header: []string{"workload", "metric"}}
	for _, c := range cols {
		if c.Ratio {
			g.Header = append(g.Header, c.Mode+"/host")
		} else {
			g.Header = append(g.Header, c.Mode)
		}
	}
	for _, w := range r.Config.Workloads {
		first := len(g.Rows)
		for _, metric := range r.metricsOf(w) {
			g.Rows = append(g.Rows, r.metricRow(w, metric, cols))
		}
		if len(g.Rows) == first {
			continue
		}
		g.Rows = append(g.Rows, r.cpuRow(w, cols))
		g.Rows[first][0] = w
	}
	return g
}

// metricsOf lists a workload's metrics in report order.
func (r *Report) metricsOf(workload string) []string {
	var metrics []string
	for _, res := range r.Results {
		if res.Workload == workload && !slices.Contains(metrics, res.Metric) {
			metrics = append(metrics, res.Metric)
		}
	}
	return metrics
}

func (r *Report) metricRow(workload, metric string, cols []column) []string {
	row := []string{"", metric}
	for _, c := range cols {
		res, ok := r.find(workload, c.Mode, metric)
		row[1] = fmt.Sprintf("%s (%s)", metric, res.Unit)
		switch {
		case !ok:
			row = append(row, "")
		case c.Ratio && res.Paired != nil:
			row = append(row, fmt.Sprintf("%s (%.2f–%.2f)", formatRatio(&res.Paired.Ratio), res.Paired.Low, res.Paired.High))
		case c.Ratio:
			row = append(row, formatRatio(res.RatioToHost))
		default:
			row = append(row, r.formatStats(res))
		}
	}
	return row
}

// cpuRow shows CPU per unit of work (the same on every metric row of a cell).
func (r *Report) cpuRow(workload string, cols []column) []string {
	metric := r.metricsOf(workload)[0]
	host, _ := r.find(workload, HostMode, metric)
	row := []string{"", ""}
	for _, c := range cols {
		res, _ := r.find(workload, c.Mode, metric)
		row[1] = fmt.Sprintf("cpu (%s)", res.CPUUnit)
		switch {
		case res.CPUPerUnit == nil:
			row = append(row, "—")
		case c.Ratio:
			var q *float64
			if host.CPUPerUnit != nil && *host.CPUPerUnit != 0 {
				q = ptr(*res.CPUPerUnit / *host.CPUPerUnit)
			}
			row = append(row, formatRatio(q))
		default:
			row = append(row, formatValue(*res.CPUPerUnit))
		}
	}
	return row
}

// formatStats prints "median (min–max)", with [k/N] when samples failed.
func (r *Report) formatStats(res Result) string {
	if res.Median == nil {
		return "FAILED"
	}
	s := formatValue(*res.Median)
	if len(res.Samples) > 1 {
		s += fmt.Sprintf(" (%s–%s)", formatValue(*res.Min), formatValue(*res.Max))
	}
	if len(res.Samples) < r.Config.Repeat {
		s += fmt.Sprintf(" [%d/%d]", len(res.Samples), r.Config.Repeat)
	}
	return s
}

func formatRatio(q *float64) string {
	if q == nil {
		return "—"
	}
	return fmt.Sprintf("%.2f×", *q)
}

// formatValue prints about three significant digits without exponents.
func formatValue(v float64) string {
	a := math.Abs(v)
	switch {
	case a >= 100:
		return fmt.Sprintf("%.0f", v)
	case a >= 10:
		return fmt.Sprintf("%.1f", v)
	case a >= 1:
		return fmt.Sprintf("%.2f", v)
	case a == 0:
		return "0"
	default:
		return fmt.Sprintf("%.3g", v)
	}
}

// machineLine describes the machine and configuration in one line.
func (r *Report) machineLine() string {
	m, c := r.Machine, r.Config
	placement := "cross-host"
	if c.SameHost {
		placement = "same-host"
	}
	return fmt.Sprintf("%s, Linux %s, %d CPUs (%s), %s; %s profile, %d× %gs cells, %s, lab mode %s",
		m.Hostname, m.Kernel, m.CPUs, m.CPUModel, m.Date, c.Profile, c.Repeat, c.CellSeconds, placement, c.LabMode)
}

// footnotes explain the table's numbers.
func (r *Report) footnotes() []string {
	notes := []string{
		fmt.Sprintf("Values: median (min–max) over %d repetition(s), modes interleaved (in reverse order every other repetition); [k/N] = only k of N samples succeeded.", r.Config.Repeat),
		fmt.Sprintf("mode/host = median ÷ host median; with %d or more repetitions, the median of the per-repetition ratios (each cell over "+
			"host's of the same repetition) and its 95 %% bootstrap interval. Above 1 is better for rate and throughput, worse for "+
			"latency (us), loss and cpu (always median ÷ host median).", minPairs),
		"cpu: whole-machine CPU time (/proc/stat, all but idle, iowait and steal) during the measured client run, divided by the work done " +
			"(transactions/requests, or Gbit received). The lab's namespaces share one kernel, so it covers client, server and the " +
			"data path on both \"hosts\", plus anything else running on the machine.",
	}
	if n := len(r.Failures); n > 0 {
		notes = append(notes, fmt.Sprintf("%d failed sample(s), not used:", n))
		for _, f := range r.Failures {
			notes = append(notes, fmt.Sprintf("  %s/%s rep %d: %s", f.Workload, f.Mode, f.Rep, f.Error))
		}
	}
	return notes
}

// WriteTable writes the report as an aligned text table for a terminal.
func (r *Report) WriteTable(w io.Writer) error {
	var b strings.Builder
	b.WriteString("skiff bench: " + r.machineLine() + "\n\n")
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	g := r.grid()
	fmt.Fprintln(tw, strings.Join(upper(g.Header), "\t"))
	for _, row := range g.Rows {
		fmt.Fprintln(tw, strings.Join(row, "\t"))
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("write table: %w", err)
	}
	b.WriteString("\n")
	for _, n := range r.footnotes() {
		b.WriteString(n + "\n")
	}
	if _, err := io.WriteString(w, b.String()); err != nil {
		return fmt.Errorf("write table: %w", err)
	}
	return nil
}

// WriteMarkdown writes the report as a Markdown section: a machine line,
// the table and its footnotes.
func (r *Report) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	b.WriteString("## skiff bench\n\n")
	b.WriteString("Machine: " + r.machineLine() + "\n\n")
	g := r.grid()
	b.WriteString(markdownRow(g.Header))
	sep := make([]string, len(g.Header))
	for i := range sep {
		sep[i] = "---:"
		if i < 2 {
			sep[i] = "---"
		}
	}
	b.WriteString(markdownRow(sep))
	for _, row := range g.Rows {
		b.WriteString(markdownRow(row))
	}
	b.WriteString("\n")
	for _, n := range r.footnotes() {
		if strings.HasPrefix(n, "  ") {
			b.WriteString("- " + strings.TrimSpace(n) + "\n") // a failure
		} else {
			b.WriteString(n + "\n\n")
		}
	}
	if _, err := io.WriteString(w, b.String()); err != nil {
		return fmt.Errorf("write markdown: %w", err)
	}
	return nil
}

func markdownRow(cells []string) string {
	escaped := make([]string, len(cells))
	for i, c := range cells {
		escaped[i] = strings.ReplaceAll(c, "|", `\|`)
	}
	return "| " + strings.Join(escaped, " | ") + " |\n"
}

func upper(s []string) []string {
	out := make([]string, len(s))
	for i, v := range s {
		out[i] = strings.ToUpper(v)
	}
	return out
}
