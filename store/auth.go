package store

import (
	"context"
	"errors"
	"fmt"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Least privilege in the store. With authentication on, etcd takes the
// common name of a client's verified certificate as its user: the
// administrator's (AdminName) holds etcd's root role; each host's user has
// a role of the same name that reads everything under Prefix and writes
// only HostRanges. The calls below need the administrator's store (or one
// whose authentication is still off).

// EnableAuth makes the administrator's user (no password: its certificate
// names it) with the root role and turns authentication on. Doing it again
// changes nothing.
func (s *Store) EnableAuth(ctx context.Context) error {
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	st, err := s.Client.AuthStatus(ctx)
	if err != nil {
		return unavailable("auth status", err)
	}
	if st.Enabled {
		return nil
	}
	if err := s.addUser(ctx, AdminName); err != nil {
		return err
	}
	if _, err := s.Client.UserGrantRole(ctx, AdminName, "root"); err != nil {
		return unavailable("grant root to "+AdminName, err)
	}
	if _, err := s.Client.AuthEnable(ctx); err != nil {
		return unavailable("enable authentication", err)
	}
	return nil
}

// AuthEnabled reports whether the store checks its clients' rights.
func (s *Store) AuthEnabled(ctx context.Context) (bool, error) {
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	st, err := s.Client.AuthStatus(ctx)
	if err != nil {
		return false, unavailable("auth status", err)
	}
	return st.Enabled, nil
}

// AllowHost makes the user and role of host: read everything of skiff's,
// write the host's own keys, and the cluster configuration (which a first
// agent creates; see docs/security.md). Doing it again changes nothing.
func (s *Store) AllowHost(ctx context.Context, host string) error {
	if err := ValidateHostName(host); err != nil {
		return err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	if err := s.addUser(ctx, host); err != nil {
		return err
	}
	if _, err := s.Client.RoleAdd(ctx, host); err != nil && !errors.Is(err, rpctypes.ErrRoleAlreadyExist) {
		return unavailable("add role "+host, err)
	}
	grant := func(r Range, perm clientv3.PermissionType) error {
		if _, err := s.Client.RoleGrantPermission(ctx, host, r.Key, r.End, perm); err != nil {
			return unavailable("grant "+host+" "+r.Key, err)
		}
		return nil
	}
	if err := grant(ReadRange, clientv3.PermissionType(clientv3.PermRead)); err != nil {
		return err
	}
	for _, r := range append(HostRanges(host), Range{Key: configKey}) {
		if err := grant(r, clientv3.PermissionType(clientv3.PermReadWrite)); err != nil {
			return err
		}
	}
	if _, err := s.Client.UserGrantRole(ctx, host, host); err != nil {
		return unavailable("grant role "+host, err)
	}
	return nil
}

// RevokeHost deletes the user and role of host: its certificate no longer
// reads or writes anything. A host without them is not an error.
func (s *Store) RevokeHost(ctx context.Context, host string) error {
	if err := ValidateHostName(host); err != nil {
		return err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	if _, err := s.Client.UserDelete(ctx, host); err != nil && !errors.Is(err, rpctypes.ErrUserNotFound) {
		return unavailable("delete user "+host, err)
	}
	if _, err := s.Client.RoleDelete(ctx, host); err != nil && !errors.Is(err, rpctypes.ErrRoleNotFound) {
		return unavailable("delete role "+host, err)
	}
	return nil
}

func (s *Store) addUser(ctx context.Context, name string) error {
	_, err := s.Client.UserAddWithOptions(ctx, name, "", &clientv3.UserAddOptions{NoPassword: true})
	if err != nil && !errors.Is(err, rpctypes.ErrUserAlreadyExist) {
		return unavailable(fmt.Sprintf("add user %s", name), err)
	}
	return nil
}
