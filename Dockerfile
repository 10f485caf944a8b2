# skiff's image for Kubernetes (deploy/kubernetes/skiff.yaml, docs/kubernetes.md):
# skiffd and what runs beside it (the socket broker, the seccomp launcher, the
# shim), the CLI (the readiness probe), and skiff-cni with portmap for the
# DaemonSet's init container to put on the node.
#
#   docker build -t skiff:dev .
#
# The eBPF objects are committed (go generate made them): no clang needed.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN make build

FROM debian:12-slim
RUN apt-get update && apt-get install -y --no-install-recommends iproute2 iptables containernetworking-plugins \
	&& rm -rf /var/lib/apt/lists/*
COPY --from=build /src/bin/skiff /src/bin/skiffd /src/bin/skiff-cni /src/bin/skiff-broker /src/bin/skiff-seccomp-exec /usr/local/bin/
COPY --from=build /src/bin/libskiff.so /usr/local/lib/skiff/libskiff.so
ENTRYPOINT ["skiffd"]
