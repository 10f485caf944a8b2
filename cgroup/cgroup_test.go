package cgroup

import "testing"

// TestSystemdPath: cgroupPath as runtimes with the systemd cgroup driver
// pass it becomes the path systemd gives the unit.
func TestSystemdPath(t *testing.T) {
	for in, want := range map[string]string{
		"kubepods-besteffort-pod123.slice:cri-containerd:abc": "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod123.slice/cri-containerd-abc.scope",
		"system.slice:docker:1234":                            "system.slice/docker-1234.scope",
		":libpod:77":                                          "system.slice/libpod-77.scope",
		"user.slice::c1":                                      "user.slice/c1.scope",
		"machine.slice:x:sub.slice":                           "machine.slice/sub.slice",
		"kubepods-besteffort-pod123.slice":                    "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod123.slice",
		"-.slice:p:n":                                         "p-n.scope",
	} {
		if got, ok := SystemdPath(in); !ok || got != want {
			t.Errorf("SystemdPath(%q) = %q %v, want %q", in, got, ok, want)
		}
	}
	for _, in := range []string{"/sys/fs/cgroup/x", "skiff-lab/h1-c1", "a--b.slice", "-a.slice:p:n", "a.slice:p:", "a.slice:p:../x", "x:y", "a.scope"} {
		if got, ok := SystemdPath(in); ok {
			t.Errorf("SystemdPath(%q) = %q, want not a systemd name", in, got)
		}
	}
}

// TestCgroupRel: every form of one cgroup compares equal.
func TestCgroupRel(t *testing.T) {
	for p, want := range map[string]string{
		"/sys/fs/cgroup/unified/skiff/c1": "/skiff/c1", "/sys/fs/cgroup/skiff/c1": "/skiff/c1", "skiff/c1": "/skiff/c1",
		"/run/skiff/cgroup2/skiff/c1/": "/skiff/c1", "skiff//c1": "/skiff/c1",
		"kubepods-besteffort-pod1.slice:cri-containerd:ID": "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/cri-containerd-ID.scope",
		"system.slice": "/system.slice",
	} {
		if got := Rel(p); got != want {
			t.Errorf("Rel(%q) = %q, want %q", p, got, want)
		}
	}
}
