package bpffs

import (
	"fmt"
	"strings"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"golang.org/x/sys/unix"
)

// sameLayout reports why m's key or value is laid out differently from
// ms's, by their BTF: a new version that reorders or retypes a struct's
// fields without changing its size must not read the old bytes as its own.
// Maps without BTF on either side are judged by their sizes alone.
func sameLayout(ms *ebpf.MapSpec, m *ebpf.Map) error {
	if ms.Key == nil && ms.Value == nil {
		return nil
	}
	info, err := mapBTF(m)
	if err != nil || info.btfID == 0 {
		return err
	}
	h, err := btf.NewHandleFromID(btf.ID(info.btfID))
	if err != nil {
		return fmt.Errorf("BTF of %s: %w", ms.Name, err)
	}
	defer h.Close()
	spec, err := h.Spec(nil)
	if err != nil {
		return fmt.Errorf("BTF of %s: %w", ms.Name, err)
	}
	for _, kv := range []struct {
		what string
		want btf.Type
		id   uint32
	}{{"key", ms.Key, info.keyType}, {"value", ms.Value, info.valueType}} {
		if kv.want == nil || kv.id == 0 {
			continue
		}
		have, err := spec.TypeByID(btf.TypeID(kv.id))
		if err != nil {
			return fmt.Errorf("BTF of %s: %w", ms.Name, err)
		}
		if a, b := layout(have), layout(kv.want); a != b {
			return fmt.Errorf("%s layout %s changed to %s: %w", kv.what, a, b, ebpf.ErrMapIncompatible)
		}
	}
	return nil
}

type btfInfo struct{ btfID, keyType, valueType uint32 }

// mapBTF reads the BTF ids of m's key and value (struct bpf_map_info:
// btf_id, btf_key_type_id and btf_value_type_id at bytes 64, 68 and 72),
// which cilium/ebpf does not expose.
func mapBTF(m *ebpf.Map) (btfInfo, error) {
	var info [88]byte
	attr := struct {
		fd, len uint32
		info    uint64
	}{uint32(m.FD()), uint32(len(info)), uint64(uintptr(unsafe.Pointer(&info[0])))}
	const objGetInfoByFD = 15 // BPF_OBJ_GET_INFO_BY_FD
	if _, _, errno := unix.Syscall(unix.SYS_BPF, objGetInfoByFD, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr)); errno != 0 {
		return btfInfo{}, fmt.Errorf("map info: %w", errno)
	}
	u32 := func(off int) uint32 { return *(*uint32)(unsafe.Pointer(&info[off])) }
	return btfInfo{u32(64), u32(68), u32(72)}, nil
}

// layout renders what decides how a type's bytes are read: field names,
// offsets and sizes, integer encodings, element counts. Field names count,
// so that two fields of one type trading places are a change; type names
// do not (__be32 and __u32 read alike).
func layout(t btf.Type) string {
	var b strings.Builder
	writeLayout(&b, t, 0)
	return b.String()
}

func writeLayout(b *strings.Builder, t btf.Type, depth int) {
	if depth > 16 {
		b.WriteString("…")
		return
	}
	switch t := btf.UnderlyingType(t).(type) {
	case *btf.Int:
		fmt.Fprintf(b, "int%d", t.Size*8)
		if t.Encoding&btf.Signed != 0 {
			b.WriteString("s")
		}
	case *btf.Enum:
		fmt.Fprintf(b, "enum%d", t.Size*8)
	case *btf.Pointer:
		b.WriteString("ptr")
	case *btf.Array:
		fmt.Fprintf(b, "[%d]", t.Nelems)
		writeLayout(b, t.Type, depth+1)
	case *btf.Struct:
		writeMembers(b, "struct", t.Size, t.Members, depth)
	case *btf.Union:
		writeMembers(b, "union", t.Size, t.Members, depth)
	default:
		fmt.Fprintf(b, "%T", t)
	}
}

func writeMembers(b *strings.Builder, kind string, size uint32, ms []btf.Member, depth int) {
	fmt.Fprintf(b, "%s%d{", kind, size)
	for i, m := range ms {
		if i > 0 {
			b.WriteString(" ")
		}
		fmt.Fprintf(b, "%s@%d", m.Name, m.Offset)
		if m.BitfieldSize > 0 {
			fmt.Fprintf(b, ":%d", m.BitfieldSize)
		}
		b.WriteString("=")
		writeLayout(b, m.Type, depth+1)
	}
	b.WriteString("}")
}
