// Package iptables changes the host's netfilter rules for skiff's layers:
// chains a layer owns, the jumps into them from the built-in chains, and
// their removal. Every change is idempotent, so reconciling twice is safe.
package iptables

import (
	"bytes"
	"fmt"
	"os/exec"
	"slices"
	"strings"
)

// Run runs iptables with args, waiting up to 5 s for the xtables lock.
func Run(args ...string) error {
	out, err := exec.Command("iptables", append([]string{"-w", "5"}, args...)...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("iptables %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// Restore applies rules with iptables-restore --noflush: every chain
// declared in rules is replaced atomically, nothing else is touched.
func Restore(rules string) error {
	cmd := exec.Command("iptables-restore", "-w", "5", "--noflush")
	cmd.Stdin = strings.NewReader(rules)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("iptables-restore: %w: %s\ninput:\n%s", err, bytes.TrimSpace(out), rules)
	}
	return nil
}

// NewChain creates table's chain unless it exists; an existing one keeps
// its rules.
func NewChain(table, chain string) error {
	if Run("-t", table, "-n", "-L", chain) == nil {
		return nil
	}
	return Run("-t", table, "-N", chain)
}

// Insert puts rule first in table's chain unless it is there.
func Insert(table, chain string, rule ...string) error {
	return ensure(table, chain, rule, "-I", chain, "1")
}

// Append appends rule to table's chain unless it is there.
func Append(table, chain string, rule ...string) error {
	return ensure(table, chain, rule, "-A", chain)
}

// ensure adds rule to chain with the add command unless it is there.
func ensure(table, chain string, rule []string, add ...string) error {
	if Run(slices.Concat([]string{"-t", table, "-C", chain}, rule)...) == nil {
		return nil
	}
	return Run(slices.Concat([]string{"-t", table}, add, rule)...)
}

// Delete deletes every copy of rule from table's chain; none is fine.
func Delete(table, chain string, rule ...string) {
	for Run(slices.Concat([]string{"-t", table, "-D", chain}, rule)...) == nil {
	}
}

// Chain is a chain a layer owns, holding exactly Rules, and the jumps into
// it.
type Chain struct {
	Table, Name string
	// Rules are the chain's rules in iptables-restore form, without the
	// leading "-A <chain>".
	Rules []string
	// Jumps are rules, in built-in chains of Table, that lead to the
	// chain; each is put first in its chain, in order.
	Jumps []Jump
}

// Jump is a rule in the built-in chain From.
type Jump struct {
	From string
	Rule []string
}

// Install replaces the chain's rules with Rules (creating it if missing)
// in one step, then adds the jumps that are missing.
func (c Chain) Install() error {
	var b strings.Builder
	fmt.Fprintf(&b, "*%s\n:%s - [0:0]\n", c.Table, c.Name)
	for _, r := range c.Rules {
		fmt.Fprintf(&b, "-A %s %s\n", c.Name, r)
	}
	b.WriteString("COMMIT\n")
	if err := Restore(b.String()); err != nil {
		return err
	}
	for _, j := range c.Jumps {
		if err := Insert(c.Table, j.From, j.Rule...); err != nil {
			return err
		}
	}
	return nil
}

// Remove deletes the jumps and the chain; what is already gone is fine.
func (c Chain) Remove() {
	for _, j := range c.Jumps {
		Delete(c.Table, j.From, j.Rule...)
	}
	if Run("-t", c.Table, "-F", c.Name) == nil {
		Run("-t", c.Table, "-X", c.Name)
	}
}

// RemoveChains removes, from every table, the chains whose names start
// with prefix and every rule of other chains that jumps to one, in one
// iptables-restore per table, and returns what it removed ("table/chain").
// It works from what iptables-save shows, so it removes what any version
// of skiff made.
func RemoveChains(prefix string) ([]string, error) {
	var removed []string
	for _, table := range []string{"raw", "mangle", "nat", "filter"} {
		out, err := exec.Command("iptables-save", "-t", table).Output()
		if err != nil {
			return removed, fmt.Errorf("iptables-save -t %s: %w", table, err)
		}
		in, chains := removal(string(out), prefix)
		if len(chains) == 0 {
			continue
		}
		if err := Restore("*" + table + "\n" + in + "COMMIT\n"); err != nil {
			return removed, err
		}
		for _, c := range chains {
			removed = append(removed, table+"/"+c)
		}
	}
	return removed, nil
}

// removal returns the iptables-restore lines that delete, from one table's
// iptables-save output, the chains named prefix* and the jumps into them,
// and those chains' names.
func removal(save, prefix string) (string, []string) {
	var chains []string
	var del strings.Builder
	for _, line := range strings.Split(save, "\n") {
		if name, ok := strings.CutPrefix(line, ":"+prefix); ok {
			chains = append(chains, prefix+strings.Fields(name)[0])
			continue
		}
		rule, ok := strings.CutPrefix(line, "-A ")
		if !ok || strings.HasPrefix(rule, prefix) {
			continue // the chain goes whole
		}
		f := strings.Fields(rule)
		for i := 1; i+1 < len(f); i++ {
			if (f[i] == "-j" || f[i] == "-g") && strings.HasPrefix(f[i+1], prefix) {
				fmt.Fprintf(&del, "-D %s\n", rule)
				break
			}
		}
	}
	for _, c := range chains {
		fmt.Fprintf(&del, "-F %s\n", c)
	}
	for _, c := range chains {
		fmt.Fprintf(&del, "-X %s\n", c)
	}
	return del.String(), chains
}

// Counted is a rule of a chain, as iptables -S shows it, and the packets
// it matched.
type Counted struct {
	Rule    string
	Packets uint64
}

// Counters lists table's chain's rules with their packet counters.
func Counters(table, chain string) ([]Counted, error) {
	out, err := exec.Command("iptables", "-w", "5", "-t", table, "-S", chain, "-v").Output()
	if err != nil {
		return nil, fmt.Errorf("iptables -S %s: %w", chain, err)
	}
	return counted(string(out)), nil
}

// counted parses iptables -S -v output: each rule carries "-c packets
// bytes", which it takes out.
func counted(out string) []Counted {
	var rules []Counted
	for _, line := range strings.Split(out, "\n") {
		if !strings.HasPrefix(line, "-A ") {
			continue
		}
		f := strings.Fields(line)
		c := Counted{}
		if i := slices.Index(f, "-c"); i >= 0 && i+2 < len(f) {
			fmt.Sscan(f[i+1], &c.Packets)
			line = strings.Join(slices.Delete(f, i, i+3), " ")
		}
		c.Rule = line
		rules = append(rules, c)
	}
	return rules
}
