package cli

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
)

// manifest is the file make install writes beside libskiff.so: one
// installed path a line (a directory ends in "/": removed when empty).
const manifest = "installed"

// cmdUninstall removes skiff from this host: first what the agent made in
// the kernel and its state (skiffd --cleanup, the skiffd beside this
// binary, with the host's config file), then the files make install put in
// place, by the manifest it wrote. The config file and an embedded etcd's
// data stay. skiffd must be stopped first: --cleanup refuses while it
// answers.
func cmdUninstall(ctx context.Context, env Env, args []string) error {
	set := flags(env, "uninstall")
	config := set.String("config", "", "skiffd's config file (its --bpf-dir, --state-dir and the layers' settings say what to remove)")
	list := set.String("manifest", "", "the installed files' list (default: ../lib/skiff/"+manifest+" from this binary's directory)")
	if err := parse(set, args); err != nil {
		return err
	}
	if set.NArg() > 0 {
		return usagef("unexpected argument %q", set.Arg(0))
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	bin := filepath.Dir(self)
	if *list == "" {
		*list = filepath.Join(bin, "..", "lib", "skiff", manifest)
	}
	paths, err := readManifest(*list)
	if err != nil {
		return fmt.Errorf("%w (was skiff installed with make install? --manifest names the list)", err)
	}
	cleanup := []string{"--cleanup"}
	if *config != "" {
		cleanup = append([]string{"--config", *config}, cleanup...)
	}
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "skiffd"), cleanup...)
	cmd.Stdout, cmd.Stderr = env.Stdout, env.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("skiffd --cleanup: %w (the files stay: run skiff uninstall again once it passes)", err)
	}
	var errs []error
	for _, p := range paths {
		dir := strings.HasSuffix(p, "/")
		err := os.Remove(p)
		switch {
		case err == nil:
			fmt.Fprintln(env.Stdout, "removed", p)
		case errors.Is(err, fs.ErrNotExist), dir && errors.Is(err, syscall.ENOTEMPTY):
		default:
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// readManifest reads make install's list: absolute paths, files before the
// directories that hold them.
func readManifest(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var paths []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		p := strings.TrimSpace(sc.Text())
		if p == "" {
			continue
		}
		if !filepath.IsAbs(p) || filepath.Clean(p) == "/" {
			return nil, fmt.Errorf("%s: %q is not an installed file's absolute path", path, p)
		}
		paths = append(paths, p)
	}
	return paths, sc.Err()
}
