// Package netlinksafe retries netlink dumps the kernel interrupted, as
// containernetworking/plugins' package of the same name does.
package netlinksafe

import (
	"errors"

	"github.com/vishvananda/netlink"
)

// attempts bounds the retries of a dump that keeps being interrupted.
const attempts = 5

// Dump runs dump until the kernel does not interrupt it because the table
// changed underneath (NLM_F_DUMP_INTR, which the netlink package reports
// as ErrDumpInterrupted with a possibly inconsistent result).
func Dump[T any](dump func() ([]T, error)) ([]T, error) {
	var err error
	for range attempts {
		var out []T
		out, err = dump()
		if !errors.Is(err, netlink.ErrDumpInterrupted) {
			return out, err
		}
	}
	return nil, err
}
