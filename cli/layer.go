package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/skiffnet/skiff/api"
)

// cmdLayer shows one running layer at length: its status, and what else it
// has to show (the cache: its entries). skiff NAME is the same, for a NAME
// that is no other command.
func cmdLayer(ctx context.Context, env Env, args []string) error {
	fs := flags(env, "layer")
	client := socketFlag(env, fs)
	asJSON := fs.Bool("json", false, "print JSON")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		return usagef("give one layer's name: skiff layer NAME (skiff status lists them)")
	}
	l, err := client().Layer(ctx, fs.Arg(0))
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(env.Stdout, l)
	}
	return printView(env.Stdout, l.View)
}

// printView prints a layer's view: each section's title, lines and table.
func printView(w io.Writer, view []api.Section) error {
	var errs []error
	for _, s := range view {
		if s.Title != "" {
			fmt.Fprintln(w, s.Title)
		}
		for _, line := range s.Lines {
			fmt.Fprintln(w, line)
		}
		if len(s.Header) == 0 {
			continue
		}
		rows := make([][]string, len(s.Rows))
		for i, r := range s.Rows {
			rows[i] = append([]string{"  " + r[0]}, r[1:]...)
		}
		errs = append(errs, table(w, "  "+strings.Join(s.Header, "\t"), rows))
	}
	return errors.Join(errs...)
}
