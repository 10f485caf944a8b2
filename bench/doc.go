// Package bench is the engine behind `skiff bench`: it measures every
// data-plane mode against the host baseline in one run on a lab.
//
// Run plans cells (repetition × workload × mode, modes interleaved and
// reversed every other repetition), and for each cell starts a server in the
// mode's server target, waits until it listens, runs a warm-up and the
// measured client in the client target, reads whole-machine CPU time around
// the measured run, and stops the server's process group. Results (median,
// min, max, ratio to host, CPU per unit of work) come out as a terminal
// table, Markdown, JSON (SCHEMA.md, checked by ValidateJSON) and an SVG
// chart.
//
// A mode is an entry of Modes: which lab mode it needs, where its server and
// client run, and how its commands are wrapped (e.g. LD_PRELOAD).
//
// The lab must run commands in network namespaces that share the file
// system with this process (the nginx workload writes its configuration to
// a temporary directory) and must have grep for the readiness probe.
package bench
