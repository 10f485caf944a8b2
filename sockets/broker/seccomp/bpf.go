package seccomp

import (
	"bytes"
	"encoding/binary"

	"golang.org/x/sys/unix"
)

// struct seccomp_data offsets: nr, arch, then args[6] of 64 bits each,
// little-endian halves (both architectures the filter knows).
const (
	offNr   = 0
	offArch = 4
	offArgs = 16
)

// Filter returns Rules as a classic BPF seccomp program for this machine's
// architecture: notify or allow, as the rules say; every call of another
// architecture or syscall is allowed.
func Filter() []unix.SockFilter { return filterFor(nativeArch()) }

func filterFor(a arch) []unix.SockFilter {
	// Each rule is a run of tests that jump to the next rule when one
	// fails and returns its action when all pass; jumps are filled in
	// once the rule's length is known.
	var prog []unix.SockFilter
	stmt := func(code uint16, k uint32) { prog = append(prog, unix.SockFilter{Code: code, K: k}) }
	const (
		ld   = unix.BPF_LD | unix.BPF_W | unix.BPF_ABS
		ret  = unix.BPF_RET | unix.BPF_K
		jeq  = unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K
		jgt  = unix.BPF_JMP | unix.BPF_JGT | unix.BPF_K
		fail = 0xff // placeholder: to the next rule
	)
	action := map[string]uint32{actNotify: unix.SECCOMP_RET_USER_NOTIF, actAllow: unix.SECCOMP_RET_ALLOW}
	stmt(ld, offArch)
	prog = append(prog, unix.SockFilter{Code: jeq, K: a.audit, Jt: 1})
	stmt(ret, unix.SECCOMP_RET_ALLOW)
	for _, r := range Rules() {
		start := len(prog)
		// tests whose false branch (or true, for "not") goes to the next rule
		test := func(code uint16, k uint32, failOnTrue bool) {
			f := unix.SockFilter{Code: code, K: k}
			if failOnTrue {
				f.Jt = fail
			} else {
				f.Jf = fail
			}
			prog = append(prog, f)
		}
		stmt(ld, offNr)
		test(jeq, a.syscall[r.Name], false)
		for _, c := range r.Args {
			lo, hi := uint32(offArgs+8*c.Index), uint32(offArgs+8*c.Index+4)
			vlo, vhi := uint32(c.Value), uint32(c.Value>>32)
			switch c.Op {
			case opEQ: // hi == vhi && lo == vlo
				stmt(ld, hi)
				test(jeq, vhi, false)
				stmt(ld, lo)
				test(jeq, vlo, false)
			case opNE: // !(hi == vhi && lo == vlo)
				stmt(ld, hi)
				prog = append(prog, unix.SockFilter{Code: jeq, K: vhi, Jf: 2}) // differs: passes
				stmt(ld, lo)
				test(jeq, vlo, true)
			case opLE: // hi < vhi || (hi == vhi && lo <= vlo)
				stmt(ld, hi)
				prog = append(prog, unix.SockFilter{Code: jgt, K: vhi, Jt: fail})
				prog = append(prog, unix.SockFilter{Code: jeq, K: vhi, Jf: 2}) // hi < vhi: passes
				stmt(ld, lo)
				test(jgt, vlo, true)
			case opGT: // hi > vhi || (hi == vhi && lo > vlo)
				stmt(ld, hi)
				prog = append(prog, unix.SockFilter{Code: jgt, K: vhi, Jt: 3})
				test(jeq, vhi, false)
				stmt(ld, lo)
				test(jgt, vlo, false)
			default:
				panic("seccomp: no BPF for " + c.Op)
			}
		}
		stmt(ret, action[r.Action])
		next := len(prog)
		for i := start; i < next; i++ {
			if prog[i].Jt == fail {
				prog[i].Jt = uint8(next - i - 1)
			}
			if prog[i].Jf == fail {
				prog[i].Jf = uint8(next - i - 1)
			}
		}
	}
	stmt(ret, unix.SECCOMP_RET_ALLOW)
	return prog
}

// FilterBytes is Filter as the array of struct sock_filter a launcher
// loads (skiff-seccomp-exec --filter).
func FilterBytes() []byte {
	var b bytes.Buffer
	for _, f := range Filter() {
		binary.Write(&b, binary.NativeEndian, f)
	}
	return b.Bytes()
}
