package cli

import (
	"context"
	"errors"
)

// cmdSteering shows the steering layer: each stage's packets per CPU, the
// decisions, the CPUs' loads.
func cmdSteering(ctx context.Context, env Env, args []string) error {
	fs := flags(env, "steering")
	client := socketFlag(env, fs)
	asJSON := fs.Bool("json", false, "print JSON")
	if err := parse(fs, args); err != nil {
		return err
	}
	st, err := client().Status(ctx)
	if err != nil {
		return err
	}
	if st.Steering == nil {
		return errors.New("the steering layer is not running on this host (skiffd --mode steering, or --layers ...,steering)")
	}
	if *asJSON {
		return printJSON(env.Stdout, st.Steering)
	}
	printSteering(env.Stdout, st.Steering)
	return nil
}
