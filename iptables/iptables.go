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
