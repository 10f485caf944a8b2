package store

import (
	"context"
	"time"

	"google.golang.org/grpc/connectivity"
)

// Connectivity reports the connection to the store as it changes: false
// when it is lost, true when it is back, until ctx ends (then the channel
// closes). A watch outlives a lost connection silently (the client resumes
// it), so this is how a caller learns that it should resync. While the
// connection is down it is retried every retry, not after gRPC's growing
// backoff (up to two minutes), so a store that returns is seen at once.
func (s *Store) Connectivity(ctx context.Context, retry time.Duration) <-chan bool {
	out := make(chan bool)
	conn := s.Client.ActiveConnection()
	go func() {
		defer close(out)
		up := true // the caller starts with a store that answered
		for {
			state := conn.GetState()
			switch state {
			case connectivity.Shutdown:
				return
			case connectivity.Idle:
				conn.Connect()
			}
			now := up
			if state == connectivity.Ready {
				now = true
			} else if state == connectivity.Connecting || state == connectivity.TransientFailure {
				now = false
			}
			if now != up {
				up = now
				select {
				case out <- up:
				case <-ctx.Done():
					return
				}
			}
			wait, cancel := ctx, context.CancelFunc(func() {})
			if !up {
				wait, cancel = context.WithTimeout(ctx, retry)
			}
			changed := conn.WaitForStateChange(wait, state)
			cancel()
			if ctx.Err() != nil {
				return
			}
			if !changed {
				conn.ResetConnectBackoff()
			}
		}
	}()
	return out
}
