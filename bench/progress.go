package bench

import (
	"fmt"
	"io"
	"strconv"
	"time"
)

// progress prints one line per cell with elapsed time and a remaining
// estimate: the planned time of the cells left, scaled by how the cells so
// far compared with their plan.
type progress struct {
	w        io.Writer
	cells    []cell
	planned  []time.Duration
	start    time.Time
	plannedN time.Duration // planned time of the cells done
	width    int           // digits of the cell count
	nameW    int
	modeW    int
}

func newProgress(w io.Writer, cells []cell, estimate func(cell) time.Duration) *progress {
	p := &progress{w: w, cells: cells, start: time.Now(), width: len(strconv.Itoa(len(cells)))}
	for _, c := range cells {
		p.planned = append(p.planned, estimate(c))
		p.nameW = max(p.nameW, len(c.Workload.Name))
		p.modeW = max(p.modeW, len(c.Mode.Name))
	}
	return p
}

func (p *progress) total() time.Duration {
	var sum time.Duration
	for _, d := range p.planned {
		sum += d
	}
	return sum
}

func (p *progress) header(desc string) {
	fmt.Fprintf(p.w, "skiff bench: %s, estimated %s\n", desc, formatDuration(p.total()))
}

func (p *progress) begin(i int, c cell) {
	fmt.Fprintf(p.w, "[%*d/%d] rep %d/%d %-*s %-*s ... ", p.width, i+1, len(p.cells),
		c.Rep, p.cells[len(p.cells)-1].Rep, p.nameW, c.Workload.Name, p.modeW, c.Mode.Name)
}

func (p *progress) end(i int, outcome string) {
	p.plannedN += p.planned[i]
	elapsed := time.Since(p.start)
	var left time.Duration
	for _, d := range p.planned[i+1:] {
		left += d
	}
	if p.plannedN > 0 {
		left = time.Duration(float64(left) * float64(elapsed) / float64(p.plannedN))
	}
	fmt.Fprintf(p.w, "%s (elapsed %s, ~%s left)\n", outcome, formatDuration(elapsed), formatDuration(left))
}

// formatDuration prints 1m05s style durations.
func formatDuration(d time.Duration) string {
	d = d.Round(time.Second)
	return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
}
