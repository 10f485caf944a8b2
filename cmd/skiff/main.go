// Command skiff is skiff's command-line tool.
package main

import (
	"context"
	"os"

	"github.com/skiffnet/skiff/cli"
)

func main() {
	os.Exit(cli.Run(context.Background(), cli.Env{Args: os.Args[1:], Stdin: os.Stdin, Stdout: os.Stdout, Stderr: os.Stderr}))
}
