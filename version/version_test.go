package version

import (
	"strings"
	"testing"
)

func TestString(t *testing.T) {
	s := String()
	if !strings.HasPrefix(s, Release+" (commit ") || !strings.HasSuffix(s, ")") {
		t.Errorf("String() = %q", s)
	}
	if c := Commit(); c == "" {
		t.Error("empty commit")
	}
}
