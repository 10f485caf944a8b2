package cni

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/skiffnet/skiff/cluster"
)

// TestAsked: the address and MAC a runtime asks for, through the ips and
// mac capabilities or CNI_ARGS (podman --ip, --mac-address).
func TestAsked(t *testing.T) {
	for _, tc := range []struct {
		name, conf, args string
		ip, mac, err     string
	}{
		{"nothing", `{}`, "", "", "", ""},
		{"ips capability", `{"runtimeConfig":{"ips":["10.244.0.7/24"]}}`, "", "10.244.0.7", "", ""},
		{"mac capability", `{"runtimeConfig":{"mac":"02:42:0a:f4:00:07"}}`, "", "", "02:42:0a:f4:00:07", ""},
		{"CNI_ARGS", `{}`, "IgnoreUnknown=1;K8S_POD_NAME=x;IP=10.244.0.9;MAC=02:00:00:00:00:09", "10.244.0.9", "02:00:00:00:00:09", ""},
		{"both the same", `{"runtimeConfig":{"ips":["10.244.0.9"]}}`, "IP=10.244.0.9", "10.244.0.9", "", ""},
		{"two addresses", `{"runtimeConfig":{"ips":["10.244.0.9","10.244.0.10"]}}`, "", "", "", "one address per network"},
		{"IPv6", `{"runtimeConfig":{"ips":["fd00::7/64"]}}`, "", "", "", "IPv4 addresses only"},
		{"garbage", `{}`, "IP=ten", "", "", `address "ten"`},
		{"ips not a list", `{"runtimeConfig":{"ips":"10.244.0.7"}}`, "", "", "", "not a list"},
		{"multicast MAC", `{"runtimeConfig":{"mac":"01:00:5e:00:00:01"}}`, "", "", "", "unicast"},
		{"short MAC", `{}`, "MAC=02:00:00:00:00", "", "", "unicast"},
	} {
		var c NetConf
		if err := json.Unmarshal([]byte(tc.conf), &c); err != nil {
			t.Fatal(err)
		}
		a, err := c.asked(tc.args)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%s: %v, want an error with %q", tc.name, err, tc.err)
			}
			continue
		}
		ip := ""
		if a.IP.IsValid() {
			ip = a.IP.String()
		}
		if err != nil || ip != tc.ip || a.MAC.String() != tc.mac {
			t.Errorf("%s: %v %v %v, want %q %q", tc.name, ip, a.MAC, err, tc.ip, tc.mac)
		}
	}
	if _, err := ParseConf([]byte(`{"cniVersion":"1.0.0","name":"skiff","type":"skiff-cni","runtimeConfig":{"mac":7}}`)); err == nil {
		t.Error("a numeric mac was accepted")
	}
}

// TestAskedClass: the QoS class is the network's ("qos"), or the one
// CNI_ARGS SKIFF_QOS= asks for; an unknown class is an error, in the
// network configuration too.
func TestAskedClass(t *testing.T) {
	for _, tc := range []struct{ conf, args, want, err string }{
		{`{}`, "", "", ""},
		{`{"qos":"low"}`, "", "low", ""},
		{`{"qos":"low"}`, "IgnoreUnknown=1;SKIFF_QOS=high", "high", ""},
		{`{}`, "SKIFF_QOS=urgent", "", "want high, normal or low"},
	} {
		var c NetConf
		if err := json.Unmarshal([]byte(tc.conf), &c); err != nil {
			t.Fatal(err)
		}
		a, err := c.asked(tc.args)
		switch {
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("%s %s: %v, want an error with %q", tc.conf, tc.args, err, tc.err)
		case tc.err == "" && (err != nil || a.Class != tc.want):
			t.Errorf("%s %s: class %q, %v; want %q", tc.conf, tc.args, a.Class, err, tc.want)
		}
	}
	if _, err := ParseConf([]byte(`{"cniVersion":"1.0.0","name":"n","type":"skiff-cni","qos":"gold"}`)); err == nil || !strings.Contains(err.Error(), "want high, normal or low") {
		t.Errorf(`"qos":"gold": %v`, err)
	}
}

// TestAskedPod: the kubelet's K8S_POD_* CNI_ARGS name the container's pod;
// a malformed one is an error, and one without the other names none.
func TestAskedPod(t *testing.T) {
	const uid = "3c0f4c4e-8a49-4f3a-9e0e-2a1b7c2d9f10"
	for _, tc := range []struct {
		args string
		want *cluster.Pod
		err  string
	}{
		{"IgnoreUnknown=1;K8S_POD_NAMESPACE=prod;K8S_POD_NAME=web-7d9f8-x2k4q;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=" + uid,
			&cluster.Pod{Namespace: "prod", Name: "web-7d9f8-x2k4q", UID: uid}, ""},
		{"K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=coredns-1.a", &cluster.Pod{Namespace: "kube-system", Name: "coredns-1.a"}, ""},
		{"K8S_POD_NAME=x", nil, ""},
		{"", nil, ""},
		{"K8S_POD_NAMESPACE=Prod;K8S_POD_NAME=web", nil, "DNS-1123 label"},
		{"K8S_POD_NAMESPACE=prod;K8S_POD_NAME=web/../x", nil, "DNS-1123 subdomain"},
		{"K8S_POD_NAMESPACE=prod;K8S_POD_NAME=web;K8S_POD_UID=1;", nil, "not a UUID"},
	} {
		var c NetConf
		a, err := c.asked(tc.args)
		switch {
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("%s: %v, want an error with %q", tc.args, err, tc.err)
		case tc.err == "" && (err != nil || !a.Pod.Equal(tc.want)):
			t.Errorf("%s: pod %+v, %v; want %+v", tc.args, a.Pod, err, tc.want)
		}
	}
}
