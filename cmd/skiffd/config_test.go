package main

import (
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestApplyConfig(t *testing.T) {
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
	if err := applyConfig(fs, conf); err != nil {
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
		err := applyConfig(fs, write(bad.conf))
		if err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%q: %v, want an error with %q", bad.conf, err, bad.want)
		}
	}
	if err := applyConfig(fs, "/nonexistent/skiffd.conf"); err == nil {
		t.Error("a missing file passed")
	}
}

// TestDeployConfig: the config file make install puts in place is one
// skiffd accepts.
func TestDeployConfig(t *testing.T) {
	if err := run([]string{"--config", "../../deploy/skiffd.conf", "--version"}); err != nil {
		t.Fatal(err)
	}
}
