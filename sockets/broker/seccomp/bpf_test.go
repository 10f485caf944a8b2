package seccomp

import (
	"encoding/binary"
	"fmt"
	"testing"

	"golang.org/x/sys/unix"
)

// run evaluates a classic BPF seccomp program on one seccomp_data (the
// instructions Filter uses: absolute word loads, JEQ/JGT, RET K).
func run(t *testing.T, prog []unix.SockFilter, archID, nr uint32, args [6]uint64) uint32 {
	t.Helper()
	data := make([]byte, 64)
	binary.LittleEndian.PutUint32(data[offNr:], nr)
	binary.LittleEndian.PutUint32(data[offArch:], archID)
	for i, a := range args {
		binary.LittleEndian.PutUint64(data[offArgs+8*i:], a)
	}
	var acc uint32
	for pc := 0; pc < len(prog); pc++ {
		f := prog[pc]
		switch f.Code {
		case unix.BPF_LD | unix.BPF_W | unix.BPF_ABS:
			acc = binary.LittleEndian.Uint32(data[f.K:])
		case unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K:
			if acc == f.K {
				pc += int(f.Jt)
			} else {
				pc += int(f.Jf)
			}
		case unix.BPF_JMP | unix.BPF_JGT | unix.BPF_K:
			if acc > f.K {
				pc += int(f.Jt)
			} else {
				pc += int(f.Jf)
			}
		case unix.BPF_RET | unix.BPF_K:
			return f.K
		default:
			t.Fatalf("instruction %d: unexpected code %#x", pc, f.Code)
		}
	}
	t.Fatal("ran off the end of the program")
	return 0
}

func TestFilter(t *testing.T) {
	const notify, allow = unix.SECCOMP_RET_USER_NOTIF, unix.SECCOMP_RET_ALLOW
	neg := func(v int64) uint64 { return uint64(v) }
	for _, a := range arches {
		prog := filterFor(a)
		if err := validate(prog); err != nil {
			t.Fatal(err)
		}
		connect, listen := a.syscall["connect"], a.syscall["listen"]
		for _, c := range []struct {
			name     string
			arch, nr uint32
			args     [6]uint64
			want     uint32
		}{
			{"connect ipv4", a.audit, connect, [6]uint64{3, 0x1000, 16}, notify},
			{"connect ipv4 high fd", a.audit, connect, [6]uint64{maxFD, 0x1000, 16}, notify},
			{"connect tagged", a.audit, connect, [6]uint64{3 | Tag, 0x1000, 16}, allow},
			{"connect negative fd", a.audit, connect, [6]uint64{neg(-1), 0x1000, 16}, allow},
			{"connect fd 2^31", a.audit, connect, [6]uint64{1 << 31, 0x1000, 16}, allow},
			{"connect unix", a.audit, connect, [6]uint64{3, 0x1000, 110}, allow},
			{"connect ipv6", a.audit, connect, [6]uint64{3, 0x1000, 28}, allow},
			{"connect len 16+2^32", a.audit, connect, [6]uint64{3, 0x1000, 16 | 1<<32}, allow},
			{"listen", a.audit, listen, [6]uint64{5, 128}, notify},
			{"listen tagged", a.audit, listen, [6]uint64{5 | Tag, 128}, allow},
			{"other syscall", a.audit, 0, [6]uint64{3, 0, 16}, allow},
			{"other arch", 0x40000003, connect, [6]uint64{3, 0x1000, 16}, allow},
		} {
			if got := run(t, prog, c.arch, c.nr, c.args); got != c.want {
				t.Errorf("%s %s: %#x, want %#x", a.goarch, c.name, got, c.want)
			}
		}
	}
}

func TestFilterBytes(t *testing.T) {
	if got, want := len(FilterBytes()), 8*len(Filter()); got != want {
		t.Fatalf("%d bytes, want %d (struct sock_filter is 8 bytes)", got, want)
	}
}

// validate checks that a program's jumps stay inside it and that it ends
// in a return (the kernel's own checks).
func validate(prog []unix.SockFilter) error {
	for i, f := range prog {
		if f.Code&0x07 == unix.BPF_JMP && (i+1+int(f.Jt) >= len(prog) || i+1+int(f.Jf) >= len(prog)) {
			return fmt.Errorf("instruction %d jumps out of the program", i)
		}
	}
	if len(prog) == 0 || prog[len(prog)-1].Code != unix.BPF_RET|unix.BPF_K {
		return fmt.Errorf("the program does not end in a return")
	}
	return nil
}
