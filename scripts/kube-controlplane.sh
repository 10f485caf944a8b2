#!/usr/bin/env bash
# A Kubernetes control plane on this machine's loopback, for tests:
#
#   kube-controlplane.sh up DIR [--etcd-servers URL]
#   kube-controlplane.sh down DIR
#
# up writes a CA, serving and client certificates, the service-account key
# pair and kubeconfigs into DIR (which must not exist or be empty), then
# starts in the background, each logging to DIR/NAME.log with its pid in
# DIR/NAME.pid:
#   etcd                     unless --etcd-servers names one: skiff's embedded
#                            etcd (`skiff lab etcd-server`, SKIFF_BIN or
#                            REPO/bin/skiff; `make build`), else `etcd` in PATH
#   kube-apiserver           https://127.0.0.1:$SKIFF_KUBE_APISERVER_PORT
#   kube-controller-manager  allocating each Node a podCIDR of the cluster CIDR
#   kube-scheduler           (SKIFF_KUBE_SCHEDULER=0: none)
# and waits (SKIFF_KUBE_TIMEOUT seconds, default 120) until each is ready. It
# then prints how long each took and its memory, and leaves DIR/env
# (KUBECONFIG=DIR/admin.kubeconfig, the server's URL) for a test to read. If
# one fails, what it started is stopped and DIR kept for its logs.
# down stops those processes (TERM, then KILL after 10 s) and removes DIR.
#
# skiff-kube is SKIFF_KUBE or REPO/bin/skiff-kube (scripts/kube-build.sh).
# Addresses (environment, defaults):
#   SKIFF_KUBE_APISERVER_PORT 16443   SKIFF_KUBE_ETCD_PORT 12379 (and +1 for peers)
#   SKIFF_KUBE_KCM_PORT 16257         SKIFF_KUBE_SCHEDULER_PORT 16259
#   SKIFF_KUBE_SERVICE_CIDR 10.96.0.0/16
#   SKIFF_KUBE_CLUSTER_CIDR 10.244.0.0/16, SKIFF_KUBE_NODE_CIDR_MASK 24
#   SKIFF_KUBE_BIND 127.0.0.1         the address every server listens on
#   SKIFF_KUBE_ADVERTISE 127.0.0.1    the apiserver's address in the kubernetes Service
#   SKIFF_KUBE_EXTRA_SANS ""          more IP: or DNS: names for the apiserver's certificate
set -euo pipefail

die() { echo "kube-controlplane: $*" >&2; exit 1; }
log() { echo "kube-controlplane: $*" >&2; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
marker=.skiff-kube-controlplane
usage="usage: kube-controlplane.sh up DIR [--etcd-servers URL] | down DIR"

(($# >= 2)) || die "$usage"
cmd=$1 dir=$2
shift 2
[ -n "$dir" ] || die "$usage"
case $dir in /*) ;; *) dir=$PWD/$dir ;; esac

# The components, in the order they start (down stops them in reverse).
components=(etcd apiserver controller-manager scheduler)

# alive NAME: the pid of DIR/NAME.pid if that process runs and is one this
# control plane started (its command line names DIR).
alive() {
	local f=$dir/$1.pid pid
	[ -f "$f" ] || return 1
	pid=$(<"$f")
	[[ $pid =~ ^[0-9]+$ ]] && [ -r "/proc/$pid/cmdline" ] || return 1
	tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$dir/" || return 1
	echo "$pid"
}

# stop: TERM to every process DIR lists, KILL to those left after 10 s.
stop() {
	local name pid pids=() i
	for ((i = ${#components[@]} - 1; i >= 0; i--)); do
		name=${components[i]}
		if pid=$(alive "$name"); then
			kill -TERM "$pid" 2>/dev/null || true
			pids+=("$pid")
		fi
	done
	for ((i = 0; i < 100; i++)); do
		local left=()
		for pid in "${pids[@]}"; do
			[ -d "/proc/$pid" ] && ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null && left+=("$pid")
		done
		((${#left[@]})) || return 0
		sleep 0.1
	done
	for pid in "${left[@]}"; do
		log "pid $pid outlived TERM: KILL"
		kill -KILL "$pid" 2>/dev/null || true
	done
}

down() {
	[ -e "$dir" ] || { log "$dir does not exist: nothing to do"; return 0; }
	[ -f "$dir/$marker" ] || die "$dir is not a control plane's directory (no $marker): not touching it"
	stop
	rm -rf -- "$dir"
	log "down: $dir removed"
}

now_ms() { date +%s%3N; }

# wait_for WHAT NAME COMMAND...: runs COMMAND until it succeeds, while NAME's
# process lives, for at most the time left of the timeout.
wait_for() {
	local what=$1 name=$2
	shift 2
	while :; do
		"$@" >/dev/null 2>&1 && return 0
		if ! alive "$name" >/dev/null; then
			log "$name exited before $what; the end of $dir/$name.log:"
			tail -n 25 "$dir/$name.log" >&2 || true
			return 1
		fi
		if (($(now_ms) > deadline)); then
			log "$name: no $what within ${timeout}s; the end of $dir/$name.log:"
			tail -n 25 "$dir/$name.log" >&2 || true
			return 1
		fi
		sleep 0.2
	done
}

# start NAME COMMAND...: runs COMMAND in a session of its own, in the
# background, logging to DIR/NAME.log. The pid is the one COMMAND runs as
# (setsid forks when it leads a process group, under job control).
start() {
	local name=$1 i
	shift
	rm -f "$dir/$name.pid"
	started[$name]=$(now_ms)
	setsid sh -c 'echo $$ >"$0.tmp" && mv "$0.tmp" "$0" && exec "$@"' "$dir/$name.pid" "$@" </dev/null >"$dir/$name.log" 2>&1 &
	for ((i = 0; i < 50; i++)); do
		[ -s "$dir/$name.pid" ] && return 0
		sleep 0.1
	done
	die "$name did not start: $(tail -n 5 "$dir/$name.log")"
}

# https_ok URL: a 200 from URL, trusting DIR's CA.
https_ok() { curl -sf --max-time 2 --cacert "$dir/pki/ca.crt" "$1"; }

# admin_ok PATH: a 200 from the apiserver's PATH, as the administrator.
admin_ok() { curl -sf --max-time 2 --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" "$server$1"; }

# cert NAME CN O [SAN [CA]]: a key and a certificate of DIR's CA (or of CA).
cert() {
	local name=$1 cn=$2 o=$3 san=${4:-} ca=${5:-ca} subj ext
	subj="/CN=$cn"
	[ -n "$o" ] && subj="/O=$o$subj"
	ext=$pki/$name.ext
	if [ -n "$san" ]; then
		printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=%s\n' "$san" >"$ext"
	else
		printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n' >"$ext"
	fi
	openssl req -new -newkey rsa:2048 -nodes -keyout "$pki/$name.key" -subj "$subj" -out "$pki/$name.csr" 2>/dev/null
	openssl x509 -req -in "$pki/$name.csr" -CA "$pki/$ca.crt" -CAkey "$pki/$ca.key" -CAcreateserial \
		-days 365 -sha256 -extfile "$ext" -out "$pki/$name.crt" 2>/dev/null
	rm -f "$pki/$name.csr" "$ext"
}

# kubeconfig NAME USER: DIR/NAME.kubeconfig for USER's certificate.
kubeconfig() {
	local kc=$dir/$1.kubeconfig user=$2
	cat >"$kc" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: skiff
  cluster:
    server: $server
    certificate-authority: $pki/ca.crt
users:
- name: $user
  user:
    client-certificate: $pki/$user.crt
    client-key: $pki/$user.key
contexts:
- name: $user@skiff
  context:
    cluster: skiff
    user: $user
current-context: $user@skiff
EOF
}

# rss NAME: the resident memory of NAME's process, in MiB.
rss() {
	local pid
	pid=$(alive "$1") || { echo "-"; return; }
	awk '/^VmRSS:/ { printf "%.0f MiB", $2 / 1024 }' "/proc/$pid/status"
}

up() {
	local etcd_servers=""
	while (($#)); do
		case $1 in
		--etcd-servers) (($# >= 2)) || die "--etcd-servers needs a URL"; etcd_servers=$2; shift 2 ;;
		*) die "$usage" ;;
		esac
	done
	local kube=${SKIFF_KUBE:-$repo/bin/skiff-kube}
	[ -x "$kube" ] || die "no skiff-kube at $kube: run scripts/kube-build.sh (make kube-deps) or set SKIFF_KUBE"
	for tool in openssl curl setsid; do
		command -v $tool >/dev/null || die "$tool is missing"
	done
	if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ]; then
		die "$dir exists and is not empty (kube-controlplane.sh down $dir removes a control plane's)"
	fi

	local bind=${SKIFF_KUBE_BIND:-127.0.0.1}
	local advertise=${SKIFF_KUBE_ADVERTISE:-$bind}
	local api_port=${SKIFF_KUBE_APISERVER_PORT:-16443}
	local etcd_port=${SKIFF_KUBE_ETCD_PORT:-12379}
	local kcm_port=${SKIFF_KUBE_KCM_PORT:-16257}
	local sched_port=${SKIFF_KUBE_SCHEDULER_PORT:-16259}
	local service_cidr=${SKIFF_KUBE_SERVICE_CIDR:-10.96.0.0/16}
	local cluster_cidr=${SKIFF_KUBE_CLUSTER_CIDR:-10.244.0.0/16}
	local mask=${SKIFF_KUBE_NODE_CIDR_MASK:-24}
	timeout=${SKIFF_KUBE_TIMEOUT:-120}
	# The first address of the service range is the kubernetes Service's:
	# the apiserver's certificate names it.
	[[ $service_cidr =~ ^([0-9]+)\.([0-9]+)\.([0-9]+)\.([0-9]+)/[0-9]+$ ]] ||
		die "SKIFF_KUBE_SERVICE_CIDR $service_cidr: want an IPv4 network A.B.C.D/N"
	local svc_ip=${BASH_REMATCH[1]}.${BASH_REMATCH[2]}.${BASH_REMATCH[3]}.$((BASH_REMATCH[4] + 1))
	server=https://$bind:$api_port
	[[ $bind == *:* ]] && server=https://[$bind]:$api_port
	# A port something else listens on would answer the readiness checks of
	# the component that failed to take it.
	local port ports=("$api_port" "$kcm_port")
	[ -z "$etcd_servers" ] && ports+=("$etcd_port" $((etcd_port + 1)))
	[ "${SKIFF_KUBE_SCHEDULER:-1}" != 0 ] && ports+=("$sched_port")
	for port in "${ports[@]}"; do
		if (exec 3<>"/dev/tcp/$bind/$port") 2>/dev/null; then
			die "$bind:$port is in use (another control plane? SKIFF_KUBE_*_PORT choose others)"
		fi
	done

	mkdir -p "$dir"
	touch "$dir/$marker"
	pki=$dir/pki
	mkdir -p "$pki"
	chmod 0700 "$pki"
	local t0
	t0=$(now_ms)
	# ca signs everything but the front proxy's client certificate: the
	# apiserver's to the aggregated apiservers, of a CA of its own that the
	# components' delegated authentication reads (without one, they log an
	# error about the missing requestheader-client-ca-file every few seconds).
	local c
	for c in ca:skiff-kube-ca front-proxy-ca:skiff-kube-front-proxy-ca; do
		openssl req -x509 -newkey rsa:2048 -nodes -keyout "$pki/${c%%:*}.key" -out "$pki/${c%%:*}.crt" -days 365 -sha256 \
			-subj "/CN=${c#*:}" -addext "basicConstraints=critical,CA:TRUE" \
			-addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" 2>/dev/null || die "openssl could not make a CA"
	done
	local sans="DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost,IP:127.0.0.1,IP:$svc_ip,IP:$bind,IP:$advertise"
	[ -n "${SKIFF_KUBE_EXTRA_SANS:-}" ] && sans+=",$SKIFF_KUBE_EXTRA_SANS"
	cert apiserver kube-apiserver "" "$sans"
	cert localhost localhost "" "DNS:localhost,IP:127.0.0.1,IP:$bind"
	cert admin kubernetes-admin system:masters
	cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
	cert controller-manager system:kube-controller-manager ""
	cert scheduler system:kube-scheduler ""
	cert front-proxy-client front-proxy-client "" "" front-proxy-ca
	openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
	openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
	kubeconfig admin admin
	kubeconfig controller-manager controller-manager
	kubeconfig scheduler scheduler
	log "certificates and kubeconfigs in $dir: $(($(now_ms) - t0)) ms"

	declare -gA started=() ready=()
	deadline=$(($(now_ms) + timeout * 1000))
	upok=0
	trap 'if ((!upok)); then log "up failed: stopping what started; logs kept in $dir (down $dir removes it)"; stop; fi' EXIT

	if [ -z "$etcd_servers" ]; then
		local skiff=${SKIFF_BIN:-$repo/bin}/skiff
		local etcd_url=http://$bind:$etcd_port peer_url=http://$bind:$((etcd_port + 1))
		if [ -x "$skiff" ]; then
			start etcd "$skiff" lab etcd-server --dir "$dir/etcd" --listen "$etcd_url" --peer "$peer_url" --etcd-insecure
		elif command -v etcd >/dev/null; then
			start etcd etcd --name skiff-kube --data-dir "$dir/etcd" --listen-client-urls "$etcd_url" \
				--advertise-client-urls "$etcd_url" --listen-peer-urls "$peer_url" \
				--initial-advertise-peer-urls "$peer_url" --initial-cluster "skiff-kube=$peer_url"
		else
			die "no etcd: build skiff (make build; SKIFF_BIN names its directory), install etcd, or pass --etcd-servers"
		fi
		wait_for "health" etcd curl -sf --max-time 2 "$etcd_url/health"
		ready[etcd]=$(now_ms)
		etcd_servers=$etcd_url
	else
		components=("${components[@]:1}")
	fi

	# The kubernetes Service's endpoint is the advertised address, and an
	# Endpoints address may not be loopback: on loopback, no reconciler (else
	# it fails every 10 s), and the Service has no endpoint.
	local reconciler=lease
	[[ $advertise == 127.* || $advertise == ::1 ]] && reconciler=none

	start apiserver "$kube" apiserver \
		--advertise-address="$advertise" --bind-address="$bind" --secure-port="$api_port" \
		--etcd-servers="$etcd_servers" \
		--service-cluster-ip-range="$service_cidr" \
		--service-account-issuer=https://kubernetes.default.svc.cluster.local \
		--service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
		--tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
		--client-ca-file="$pki/ca.crt" \
		--kubelet-client-certificate="$pki/apiserver-kubelet-client.crt" \
		--kubelet-client-key="$pki/apiserver-kubelet-client.key" \
		--kubelet-preferred-address-types=InternalIP,ExternalIP,Hostname \
		--requestheader-client-ca-file="$pki/front-proxy-ca.crt" --requestheader-allowed-names=front-proxy-client \
		--requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group \
		--requestheader-extra-headers-prefix=X-Remote-Extra- \
		--proxy-client-cert-file="$pki/front-proxy-client.crt" --proxy-client-key-file="$pki/front-proxy-client.key" \
		--authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
		--allow-privileged=true --endpoint-reconciler-type="$reconciler"
	wait_for "/readyz" apiserver https_ok "$server/readyz"
	ready[apiserver]=$(now_ms)

	start controller-manager "$kube" controller-manager \
		--kubeconfig="$dir/controller-manager.kubeconfig" \
		--authentication-kubeconfig="$dir/controller-manager.kubeconfig" \
		--authorization-kubeconfig="$dir/controller-manager.kubeconfig" \
		--bind-address="$bind" --secure-port="$kcm_port" \
		--tls-cert-file="$pki/localhost.crt" --tls-private-key-file="$pki/localhost.key" \
		--client-ca-file="$pki/ca.crt" --root-ca-file="$pki/ca.crt" \
		--cluster-signing-cert-file="$pki/ca.crt" --cluster-signing-key-file="$pki/ca.key" \
		--service-account-private-key-file="$pki/sa.key" --use-service-account-credentials=true \
		--controllers='*,bootstrapsigner,tokencleaner' --leader-elect=false \
		--allocate-node-cidrs=true --cluster-cidr="$cluster_cidr" --node-cidr-mask-size="$mask" \
		--service-cluster-ip-range="$service_cidr"
	if [ "${SKIFF_KUBE_SCHEDULER:-1}" != 0 ]; then
		start scheduler "$kube" scheduler \
			--kubeconfig="$dir/scheduler.kubeconfig" \
			--authentication-kubeconfig="$dir/scheduler.kubeconfig" \
			--authorization-kubeconfig="$dir/scheduler.kubeconfig" \
			--bind-address="$bind" --secure-port="$sched_port" \
			--tls-cert-file="$pki/localhost.crt" --tls-private-key-file="$pki/localhost.key" \
			--leader-elect=false
	fi
	# Its /healthz answers before its controllers run (about 2 s later):
	# ready is when the serviceaccount controller made default/default. A Node
	# made before then still gets its podCIDR once node-ipam runs.
	wait_for "/healthz" controller-manager https_ok "https://$bind:$kcm_port/healthz"
	if [ -n "${started[scheduler]:-}" ]; then
		wait_for "/readyz" scheduler https_ok "https://$bind:$sched_port/readyz"
		ready[scheduler]=$(now_ms)
	fi
	wait_for "the default ServiceAccount" controller-manager admin_ok /api/v1/namespaces/default/serviceaccounts/default
	ready[controller-manager]=$(now_ms)
	upok=1

	cat >"$dir/env" <<EOF
KUBECONFIG=$dir/admin.kubeconfig
SKIFF_KUBE=$kube
SKIFF_KUBE_SERVER=$server
SKIFF_KUBE_ETCD_SERVERS=$etcd_servers
SKIFF_KUBE_SERVICE_CIDR=$service_cidr
SKIFF_KUBE_CLUSTER_CIDR=$cluster_cidr
EOF
	local name
	for name in "${components[@]}"; do
		[ -n "${started[$name]:-}" ] || continue
		log "$(printf '%-18s pid %-7s ready in %5d ms, RSS %s' "$name" "$(alive "$name")" \
			$((ready[$name] - started[$name])) "$(rss "$name")")"
	done
	log "up in $(($(now_ms) - t0)) ms: KUBECONFIG=$dir/admin.kubeconfig (and $dir/env)"
}

case $cmd in
up) up "$@" ;;
down) (($# == 0)) || die "$usage"; down ;;
*) die "$usage" ;;
esac
