package cli

import (
	"context"
	"fmt"
	"sort"

	"github.com/skiffnet/skiff/cache"
)

func cmdCache(ctx context.Context, env Env, args []string) error {
	fs := flags(env, "cache")
	client := socketFlag(env, fs)
	asJSON := fs.Bool("json", false, "print JSON")
	if err := parse(fs, args); err != nil {
		return err
	}
	v, err := client().Cache(ctx)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(env.Stdout, v)
	}
	w := env.Stdout
	fmt.Fprintln(w, "counters (packets):")
	printCounters(env, v.Stats)
	e := v.Entries
	fmt.Fprintf(w, "\negress: container → host (%d)\n", len(e.EgressIPs))
	var rows [][]string
	for _, x := range e.EgressIPs {
		rows = append(rows, []string{x.Container.String(), x.Host.String()})
	}
	table(w, "CONTAINER\tHOST", rows)
	fmt.Fprintf(w, "\negress: host → headers (%d)\n", len(e.EgressHosts))
	rows = nil
	for _, x := range e.EgressHosts {
		rows = append(rows, []string{x.Host.String(), fmt.Sprint(x.Ifindex), x.OuterSrc + " → " + x.OuterDst,
			fmt.Sprint(x.VNI), x.InnerSrc + " → " + x.InnerDst})
	}
	table(w, "HOST\tIFINDEX\tOUTER MACS\tVNI\tINNER MACS", rows)
	fmt.Fprintf(w, "\ningress: local container (%d)\n", len(e.Ingress))
	rows = nil
	for _, x := range e.Ingress {
		rows = append(rows, []string{x.Container.String(), fmt.Sprint(x.Ifindex), x.MACSrc + " → " + x.MACDst, fmt.Sprint(x.Ready)})
	}
	table(w, "CONTAINER\tVETH IFINDEX\tMACS\tREADY", rows)
	fmt.Fprintf(w, "\nflows (%d)\n", len(e.Flows))
	rows = nil
	for _, x := range e.Flows {
		rows = append(rows, []string{x.Proto, x.Local, x.Remote, fmt.Sprint(x.Egress), fmt.Sprint(x.Ingress)})
	}
	return table(w, "PROTO\tLOCAL\tREMOTE\tEGRESS\tINGRESS", rows)
}

// printCounters prints the non-zero counters in program order.
func printCounters(env Env, stats map[string]uint64) {
	var rows [][]string
	for _, r := range cache.Reasons {
		if n := stats[r.Name]; n > 0 {
			rows = append(rows, []string{"  " + r.Program, r.Outcome, fmt.Sprint(n)})
		}
	}
	sort.SliceStable(rows, func(i, j int) bool { return rows[i][0] < rows[j][0] })
	table(env.Stdout, "  PROGRAM\tOUTCOME\tPACKETS", rows)
}
