package flagfile

import (
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestApply: a file's flags are set unless the command line set them;
// bad lines are errors naming them; ApplyKnown skips other programs' keys.
func TestApply(t *testing.T) {
	write := func(s string) string {
		p := filepath.Join(t.TempDir(), "skiffd.conf")
		if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	newFlags := func() (*flag.FlagSet, *string, *int, *bool) {
		fs := flag.NewFlagSet("skiffd", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		return fs, fs.String("mode", "auto", ""), fs.Int("vni", 1, ""), fs.Bool("sockets-secure", true, "")
	}
	fs, mode, vni, secure := newFlags()
	if err := fs.Parse([]string{"--vni", "7"}); err != nil {
		t.Fatal(err)
	}
	conf := write("# a host's settings\nmode = cache   # the cache alone\n--vni = 9\nsockets-secure = false\n\n")
	if err := Apply(fs, conf); err != nil {
		t.Fatal(err)
	}
	if *mode != "cache" || *vni != 7 || *secure {
		t.Errorf("mode %q vni %d secure %v; want cache, 7 (the command line wins), false", *mode, *vni, *secure)
	}
	for _, bad := range []struct{ conf, want string }{
		{"mood = cache\n", `"mood" is not a skiffd flag`},
		{"mode cache\n", "want flag = value"},
		{"vni = seven\n", "vni: "},
		{"mode = a\nmode = b\n", "given again (first on line 1)"},
		{"config = x\n", "not a skiffd flag"},
	} {
		fs, _, _, _ := newFlags()
		fs.String("config", "", "")
		err := Apply(fs, write(bad.conf))
		if err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%q: %v, want an error with %q", bad.conf, err, bad.want)
		}
	}
	if err := Apply(fs, "/nonexistent/skiffd.conf"); err == nil {
		t.Error("a missing file passed")
	}
	fs, mode, _, _ = newFlags()
	if err := ApplyKnown(fs, write("name = node2\nmode = cache\n")); err != nil || *mode != "cache" {
		t.Errorf("another program's file: %v, mode %q; want cache", err, *mode)
	}
	if err := Apply(fs, write("name = node2\n")); err == nil {
		t.Error("a key of another program passed Apply")
	}
}
