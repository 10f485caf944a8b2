package cli

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/store"
)

const limitUsage = "usage: skiff limit set CONTAINER [--if IF] [--egress RATE] [--egress-burst SIZE] [--ingress RATE] [--ingress-burst SIZE] [--class high|normal|low] | del CONTAINER [--if IF] | list [--json]"

// cmdLimit changes containers' rate limits while they run: the limit set
// takes the place of the one the runtime asked for (CNI bandwidth) until
// it is deleted. Agents apply it within a second.
func cmdLimit(ctx context.Context, env Env, args []string) error {
	fs := flags(env, "limit")
	client := socketFlag(env, fs)
	admin := adminStore(env, fs)
	ifName := fs.String("if", "", "the container's interface (needed when it has several on skiff)")
	var rates [4]*string
	for i, name := range []string{"egress", "egress-burst", "ingress", "ingress-burst"} {
		what := "RATE (tc units: 100mbit, 1gbit; none lifts the limit)"
		if strings.HasSuffix(name, "burst") {
			what = "SIZE (tc units: 64kb, 1mb; default 10 ms at the rate)"
		}
		rates[i] = fs.String(name, "", name+" "+what)
	}
	class := fs.String("class", "", "QoS class: high, normal or low (docs/limits.md)")
	asJSON := fs.Bool("json", false, "print JSON (list)")
	usageLine(fs, limitUsage)
	if err := parse(fs, args); err != nil {
		return err
	}
	rest := fs.Args()
	if len(rest) == 0 {
		return usagef(limitUsage)
	}
	switch rest[0] {
	case "list", "ls":
		eps, err := client().Endpoints(ctx, true)
		if err != nil {
			return err
		}
		var rows [][]string
		var limited []api.EndpointStatus
		for _, e := range eps {
			if e.Limit.None() && !e.Limit.Marks() && !e.LimitSet {
				continue
			}
			limited = append(limited, e)
			by := "runtime"
			if e.LimitSet {
				by = "skiff limit"
			}
			rows = append(rows, []string{e.Host, e.ContainerID, e.IfName, e.IP.String(), direction(e.Limit.EgressRate, e.Limit.EgressBurst),
				direction(e.Limit.IngressRate, e.Limit.IngressBurst), cmp.Or(e.Limit.Class, cluster.ClassNormal), by})
		}
		if *asJSON {
			return printJSON(env.Stdout, limited)
		}
		return table(env.Stdout, "HOST\tCONTAINER\tIF\tIP\tEGRESS\tINGRESS\tCLASS\tSET BY", rows)
	case "set", "del", "delete", "rm":
		if len(rest) != 2 {
			return usagef(limitUsage)
		}
	default:
		return usagef("unknown limit command %q (set, del, list)", rest[0])
	}
	eps, err := client().Endpoints(ctx, true)
	if err != nil {
		return err
	}
	e, err := findEndpoint(eps, rest[1], *ifName)
	if err != nil {
		return err
	}
	if rest[0] != "set" {
		return withStore(admin, func(s *store.Store) error { return s.DeleteLimit(ctx, e.Host, e.ContainerID, e.IfName) })
	}
	l, err := setLimit(e.Limit, rates, *class)
	if err != nil {
		return usageError{err}
	}
	o := cluster.LimitOverride{Host: e.Host, ContainerID: e.ContainerID, IfName: e.IfName, Limit: l}
	if err := withStore(admin, func(s *store.Store) error { return s.PutLimit(ctx, o) }); err != nil {
		return err
	}
	fmt.Fprintf(env.Stdout, "%s/%s on %s: %s\n", e.ContainerID, e.IfName, e.Host, l)
	return nil
}

func direction(rate, burst uint64) string {
	if rate == 0 {
		return "-"
	}
	return cluster.FormatRate(rate) + " burst " + cluster.FormatSize(burst)
}

// setLimit changes the directions given (egress, egress burst, ingress,
// ingress burst; "" leaves one as it is) and the class (the same) of the
// limit in force: a rate given without a burst takes the default burst,
// "none" lifts a direction.
func setLimit(l cluster.Limit, given [4]*string, class string) (cluster.Limit, error) {
	if *given[0] == "" && *given[1] == "" && *given[2] == "" && *given[3] == "" && class == "" {
		return l, errors.New("give --egress, --ingress, a burst or --class: nothing to set")
	}
	if class != "" {
		l.Class = class
	}
	dirs := []struct {
		rate, burst *uint64
		r, b        string
	}{{&l.EgressRate, &l.EgressBurst, *given[0], *given[1]}, {&l.IngressRate, &l.IngressBurst, *given[2], *given[3]}}
	for _, d := range dirs {
		if d.r != "" {
			rate, err := cluster.ParseRate(d.r)
			if err != nil {
				return l, err
			}
			*d.rate, *d.burst = rate, cluster.DefaultBurst(rate)
		}
		if d.b != "" {
			burst, err := cluster.ParseSize(d.b)
			if err != nil {
				return l, err
			}
			*d.burst = burst
		}
	}
	if err := l.Validate(); err != nil {
		return l, err
	}
	return l.Clamp(), nil
}

// findEndpoint finds a container's endpoint by its ID, or a prefix of it
// that names one container alone.
func findEndpoint(eps []api.EndpointStatus, id, ifName string) (cluster.Endpoint, error) {
	match := func(prefix bool) []cluster.Endpoint {
		var found []cluster.Endpoint
		for _, e := range eps {
			if (e.ContainerID == id || prefix && strings.HasPrefix(e.ContainerID, id)) && (ifName == "" || e.IfName == ifName) {
				found = append(found, e.Endpoint)
			}
		}
		return found
	}
	found := match(false)
	if len(found) == 0 {
		found = match(true)
	}
	switch len(found) {
	case 0:
		if ifName != "" {
			return cluster.Endpoint{}, fmt.Errorf("no container %q with interface %s on skiff", id, ifName)
		}
		return cluster.Endpoint{}, fmt.Errorf("no container %q on skiff", id)
	case 1:
		return found[0], nil
	}
	var names []string
	for _, e := range found {
		names = append(names, e.ContainerID+"/"+e.IfName)
	}
	return cluster.Endpoint{}, usagef("%q names %d endpoints (%s): give more of the ID, or --if", id, len(found), strings.Join(names, ", "))
}
