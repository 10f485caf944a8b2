# skiff — see README.md. Everything runs as root (namespaces, netlink, eBPF).
GO      ?= go
BIN     := $(CURDIR)/bin
CMDS    := skiff skiffd skiff-cni

.PHONY: scale all deps kube-deps build test unit run clean vet bench-check bench-kube install uninstall install-check check-generated

all: build

deps:
	./scripts/deps.sh

# The Kubernetes lab's tools (docs/design/kubernetes-lab.md): skiff-kube, built
# once per kube/tools content into SKIFF_KUBE_CACHE (default
# /var/cache/skiff/kube; about 5 minutes cold) and linked as bin/skiff-kube,
# and the registry-free pause and busybox image tarballs beside it.
kube-deps:
	./scripts/kube-build.sh
	./scripts/kube-images.sh

# -buildvcs=auto: the binaries carry their commit (skiff bench records it in
# its JSON) even where GOFLAGS turns VCS stamping off.
build:
	@mkdir -p $(BIN)
	$(foreach c,$(CMDS),$(GO) build -buildvcs=auto -o $(BIN)/$(c) ./cmd/$(c) &&) true
	$(MAKE) -C perf
	install -m 0755 perf/skiff-perf $(BIN)/skiff-perf
	$(MAKE) -C sockets/broker
	$(MAKE) -C sockets/shim
	install -m 0755 sockets/broker/skiff-broker sockets/broker/skiff-seccomp-exec sockets/shim/sockcheck $(BIN)/
	install -m 0644 sockets/shim/libskiff.so $(BIN)/libskiff.so
	$(MAKE) -C slim/shim
	install -m 0644 slim/shim/libslim.so $(BIN)/libslim.so

vet:
	$(GO) vet ./...
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt needed"; exit 1; }

# The committed eBPF objects are what their C sources compile to: every
# package with a gen.go regenerated, and nothing may differ.
check-generated:
	$(GO) generate $(addprefix ./,$(dir $(wildcard */gen.go)))
	@git diff --quiet -- '*_bpfel*.go' '*_bpfel*.o' || { git diff --stat -- '*_bpfel*.go' '*_bpfel*.o'; \
		echo "committed eBPF objects differ from their C sources: run go generate and commit them"; exit 1; }

# Unit tests, eBPF golden-packet tests and lab integration tests.
test: build vet install-check check-generated
	./scripts/kube-build.sh >/dev/null # cached: nothing to do after make deps
	$(MAKE) -C perf test
	$(MAKE) -C sockets/shim test
	SKIFF_BIN_DIR=$(BIN) $(GO) test -count=1 -timeout 25m ./...

# Unit and golden-packet tests, no lab (-short). As root, like make test:
# the golden-packet tests load eBPF programs and run them (BPF_PROG_RUN).
unit:
	$(GO) test -count=1 -short ./...

# The regression gate a person runs before resolving any issue that
# touches a data path (timing is not a test on a shared machine: not in CI).
# One paired run, cross-host, of auto, auto-plain and each layer alone
# against host; prints the table and PASS/FAIL per floor (bench/check.go)
# and keeps the JSON with the commit it measured under docs/bench/.
# Then the same modes on one host (channels among them), kept beside it.
# About an hour.
CHECK_WORKLOADS ?= tcp_stream,tcp_stream_4,udp_rr,tcp_rr,tcp_crr,connect,memcached,nginx,nginx_crr
bench-check: build
	@mkdir -p docs/bench
	./bin/skiff bench --modes host,overlay,cache,sockets,auto,auto-plain --workloads $(CHECK_WORKLOADS) \
		--cell 3s --repeat 5 --check --json docs/bench/check.json --markdown docs/bench/check.md; \
	cross=$$?; \
	./bin/skiff bench --same-host --modes host,overlay,channels,sockets,auto,auto-plain --workloads $(CHECK_WORKLOADS) \
		--cell 3s --repeat 5 --check --json docs/bench/check-same-host.json --markdown docs/bench/check-same-host.md; \
	test $$cross -eq 0 -a $$? -eq 0

# How the cost grows (docs/BENCHMARKS.md "How skiff scales"): pod bursts of
# 10 to 200 on one host, labs of 2 to 50 hosts, 10 to 10 000 policy rules,
# 1 000 to 100 000 concurrent flows, each part on a lab of its own, in
# auto (bench/scale). About 15 minutes.
scale: build
	@mkdir -p docs/bench
	./bin/skiff bench --scale --json docs/bench/scale.json --markdown docs/bench/scale.md --chart docs/bench/scale.svg

# Kubernetes (docs/kubernetes.md): pods on two kube lab nodes, directly and
# through a ClusterIP Service, beside the lab's host and auto containers
# (docs/bench/kube.json, kube.md); then 50 pods per node at once, every CNI
# call timed (docs/bench/kube-burst.json). About 20 minutes.
bench-kube: build
	SKIFF_BIN_DIR=$(CURDIR)/bin go test -count=1 -run '^$$' -bench Kube -benchtime 1x -timeout 60m -v ./lab/

# Installing on a host (docs/install.md). DESTDIR stages a package.
PREFIX      ?= /usr/local
BINDIR      ?= $(PREFIX)/bin
LIBDIR      ?= $(PREFIX)/lib/skiff
DOCDIR      ?= $(PREFIX)/share/doc/skiff
SYSCONFDIR  ?= /etc
UNITDIR     ?= /etc/systemd/system
CNI_BIN_DIR ?= /opt/cni/bin
CNI_NET_DIR ?= /etc/cni/net.d
INSTALLED   := $(BINDIR)/skiff $(BINDIR)/skiffd $(BINDIR)/skiff-broker $(BINDIR)/skiff-seccomp-exec \
	$(LIBDIR)/libskiff.so $(CNI_BIN_DIR)/skiff-cni $(CNI_NET_DIR)/10-skiff.conflist $(UNITDIR)/skiffd.service \
	$(DOCDIR)/install.md $(LIBDIR)/installed

# skiffd needs skiff-broker beside it; the config file is kept when there
# is one (it is the host's).
install: build
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIBDIR) $(DESTDIR)$(CNI_BIN_DIR) $(DESTDIR)$(CNI_NET_DIR) \
		$(DESTDIR)$(UNITDIR) $(DESTDIR)$(DOCDIR) $(DESTDIR)$(SYSCONFDIR)/skiff
	install -m 0755 $(BIN)/skiff $(BIN)/skiffd $(BIN)/skiff-broker $(BIN)/skiff-seccomp-exec $(DESTDIR)$(BINDIR)/
	install -m 0644 $(BIN)/libskiff.so $(DESTDIR)$(LIBDIR)/
	install -m 0755 $(BIN)/skiff-cni $(DESTDIR)$(CNI_BIN_DIR)/
	install -m 0644 deploy/cni/10-skiff.conflist $(DESTDIR)$(CNI_NET_DIR)/
	install -m 0644 docs/install.md $(DESTDIR)$(DOCDIR)/
	sed -e 's|@BINDIR@|$(BINDIR)|g' -e 's|@SYSCONFDIR@|$(SYSCONFDIR)|g' -e 's|@DOCDIR@|$(DOCDIR)|g' \
		deploy/systemd/skiffd.service.in > $(DESTDIR)$(UNITDIR)/skiffd.service
	chmod 0644 $(DESTDIR)$(UNITDIR)/skiffd.service
	test -e $(DESTDIR)$(SYSCONFDIR)/skiff/skiffd.conf || install -m 0644 deploy/skiffd.conf $(DESTDIR)$(SYSCONFDIR)/skiff/
	printf '%s\n' $(INSTALLED) $(LIBDIR)/ $(DOCDIR)/ > $(DESTDIR)$(LIBDIR)/installed

# Removes the installed files (the host's config file stays; skiffd
# --cleanup removes what the agent made in the kernel first; skiff
# uninstall does both, by the list install wrote).
uninstall:
	rm -f $(addprefix $(DESTDIR),$(INSTALLED))
	-rmdir $(DESTDIR)$(LIBDIR) $(DESTDIR)$(DOCDIR) 2>/dev/null

# make install into a scratch DESTDIR: every file in place, the unit's
# paths filled in, the default config accepted by the installed skiffd,
# and make uninstall leaves only the config.
install-check:
	./scripts/install-check.sh

# Builds, brings up a 2-host lab with 2 containers each and shows it working.
run: build
	./scripts/demo.sh

clean:
	-$(BIN)/skiff lab down 2>/dev/null
	$(MAKE) -C perf clean
	$(MAKE) -C sockets/shim clean
	$(MAKE) -C sockets/broker clean
	rm -rf $(BIN)
