// Package timing says where the time of a slow operation went: its steps,
// logged only when the whole took longer than it should.
package timing

import (
	"log/slog"
	"strings"
	"time"
)

// Steps times the steps of one operation.
type Steps struct {
	log   *slog.Logger
	msg   string
	slow  time.Duration
	attrs []any
	start time.Time
	last  time.Time
	took  []any // step name, milliseconds, ...
}

// Start starts timing an operation that Done logs as msg, with attrs,
// when it took slow or longer (log nil: never).
func Start(log *slog.Logger, msg string, slow time.Duration, attrs ...any) *Steps {
	now := time.Now()
	return &Steps{log: log, msg: msg, slow: slow, attrs: attrs, start: now, last: now}
}

// Step ends the step called name (spaces become underscores: the log's
// key is name_ms).
func (s *Steps) Step(name string) {
	now := time.Now()
	s.took = append(s.took, strings.ReplaceAll(name, " ", "_")+"_ms", float64(now.Sub(s.last).Microseconds())/1000)
	s.last = now
}

// Done logs the steps, as a warning, if the whole was slow.
func (s *Steps) Done() {
	if total := time.Since(s.start); total >= s.slow && s.log != nil {
		s.log.Warn(s.msg, append(append(s.attrs, "took_ms", total.Milliseconds()), s.took...)...)
	}
}
