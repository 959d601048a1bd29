"""A Kubernetes API server on loopback, for the chart's tests: etcd and kube-apiserver.

Usage: scripts/kube.py up|down|status|build

Both are Go modules: built once with the Go toolchain into `.local/bin` (four to six minutes on
2 cores, the Go proxy's modules cached after), then started on loopback with their data under
`.local/kube`. No controllers and no kubelet run: objects are admitted, validated and stored as a
cluster's API server does, and no pod ever starts. That is what the chart's tests need: whether a
cluster takes what the chart renders (field names, name lengths, immutable fields on upgrade),
which `helm lint` and a schema check do not tell.

`up` is idempotent and prints `KUBECONFIG=<path>` (a token login with every right: a loopback test
server's). Each start begins on empty storage. OUTBOX_KUBE_PORT (default 56443) and
OUTBOX_ETCD_PORT (52379, its peer port the next) move the ports. Only the standard library is
used, as in services.py.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from services import (
    HOST,
    LOCAL,
    build_lock,
    fail,
    log,
    port_open,
    reserve_ports,
    run,
    terminate,
    wait_until,
)

KUBE_VERSION = "v1.37.2"
ETCD_VERSION = "v3.7.3"
PROM_OPERATOR = "github.com/prometheus-operator/prometheus-operator"
PROM_OPERATOR_VERSION = "v0.85.0"
KUBE_PORT = int(os.environ.get("OUTBOX_KUBE_PORT", "56443"))
ETCD_PORT = int(os.environ.get("OUTBOX_ETCD_PORT", "52379"))
# A loopback test server's login, not a secret.
TOKEN = "outbox-test-token"  # noqa: S105

KUBE_DIR = LOCAL / "kube"
BUILD_DIR = KUBE_DIR / "build"
BIN = LOCAL / "bin"
APISERVER = BIN / f"kube-apiserver-{KUBE_VERSION}"
ETCD = BIN / f"etcd-{ETCD_VERSION}"
KUBECONFIG = KUBE_DIR / "kubeconfig"
CERTS = KUBE_DIR / "certs"


def go() -> str:
    found = shutil.which("go")
    if found is None:
        fail("kube: a Go toolchain is needed to build etcd and kube-apiserver")
    return found  # type: ignore[return-value]


def build() -> None:
    """kube-apiserver and etcd from their modules. k8s.io/kubernetes points its k8s.io/*
    modules at its own source tree (`replace => ./staging/...`), which its module download lacks:
    a build module of ours points them at their published versions instead."""
    with build_lock("kube"):
        if not (APISERVER.exists() and ETCD.exists()):
            _build()


def _build() -> None:
    log(f"building kube-apiserver {KUBE_VERSION} and etcd {ETCD_VERSION} (minutes, once)")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GOFLAGS": "-mod=mod"}
    info = json.loads(
        run(
            [go(), "mod", "download", "-json", f"k8s.io/kubernetes@{KUBE_VERSION}"],
            cwd=BUILD_DIR,
            env=env,
            capture_output=True,
        ).stdout
    )
    staging = f"v0.{KUBE_VERSION.split('.', 1)[1]}"  # v1.37.2 -> v0.37.2
    kubernetes_mod = Path(info["GoMod"]).read_text().splitlines()
    replaces = [
        f"replace {line.split()[0]} => {line.split()[0]} {staging}"
        for line in kubernetes_mod
        if "=> ./staging/" in line
    ]
    (go_directive,) = [line for line in kubernetes_mod if line.startswith("go ")]
    (BUILD_DIR / "go.mod").write_text(
        f"module outbox.local/kube\n\n{go_directive}\n\n"
        f"require (\n\tk8s.io/kubernetes {KUBE_VERSION}\n"
        f"\tgo.etcd.io/etcd/server/v3 {ETCD_VERSION}\n)\n\n" + "\n".join(replaces) + "\n"
    )
    version = "k8s.io/component-base/version"
    major, minor = KUBE_VERSION[1:].split(".")[:2]
    # the version the server reports (helm's .Capabilities.KubeVersion reads it)
    ldflags = (
        f"-s -w -X {version}.gitVersion={KUBE_VERSION} "
        f"-X {version}.gitMajor={major} -X {version}.gitMinor={minor}"
    )
    out = BUILD_DIR / "out"
    run(
        [
            go(),
            "build",
            "-ldflags",
            ldflags,
            "-o",
            f"{out}/",
            "k8s.io/kubernetes/cmd/kube-apiserver",
            "go.etcd.io/etcd/server/v3",
        ],
        cwd=BUILD_DIR,
        env=env,
    )
    BIN.mkdir(parents=True, exist_ok=True)
    # a binary is named after its package path, less a major version suffix: .../server/v3
    (out / "server").replace(ETCD)
    (out / "kube-apiserver").replace(APISERVER)


def pid_of(name: str) -> int | None:
    """The pid of our `name` if it runs: a pid file outlives its process, and after a restart
    of the machine its number may be another program's, which is not ours to stop."""
    binary = {"kube-apiserver": APISERVER, "etcd": ETCD}[name]
    try:
        pid = int((KUBE_DIR / f"{name}.pid").read_text())
        if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] != str(binary).encode():
            return None
        return pid
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return None


def start(name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        cmd,
        stdout=(KUBE_DIR / f"{name}.log").open("ab"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # outlives this script and the test session that started it
    )
    (KUBE_DIR / f"{name}.pid").write_text(str(proc.pid))
    return proc


def call(
    path: str, method: str = "GET", body: bytes | None = None, ctype: str = "application/json"
) -> tuple[int, bytes]:
    """One request to the API server as the test login: its status and body."""
    if (CERTS / "apiserver.crt").exists():
        tls = ssl.create_default_context(cafile=str(CERTS / "apiserver.crt"))
    else:  # made at the server's first start: nothing to trust before it answers
        tls = ssl.create_default_context()
        tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
    request = urllib.request.Request(  # noqa: S310 (our own https URL)
        f"{api_url()}{path}",
        data=body,
        method=method,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": ctype},
    )
    try:
        with urllib.request.urlopen(request, timeout=10, context=tls) as reply:  # noqa: S310
            return reply.status, reply.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read()


def api_ready() -> bool:
    try:
        return call("/readyz") == (200, b"ok")
    except OSError:
        return False


CRDS = ("servicemonitors", "podmonitors", "prometheusrules")


def install_crds() -> None:
    """The Prometheus operator's ServiceMonitor, PodMonitor and PrometheusRule definitions,
    from its Go module, as a cluster that runs the operator has them: the chart's objects of
    those kinds are then checked against the operator's own schemas."""
    info = json.loads(
        run(
            [go(), "mod", "download", "-json", f"{PROM_OPERATOR}@{PROM_OPERATOR_VERSION}"],
            cwd=KUBE_DIR,
            capture_output=True,
        ).stdout
    )
    crds = Path(info["Dir"]) / "example" / "prometheus-operator-crd"
    for plural in CRDS:
        manifest = (crds / f"monitoring.coreos.com_{plural}.yaml").read_bytes()
        status, said = call(
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
            "POST",
            manifest,
            "application/yaml",
        )
        if status not in (201, 409):
            fail(f"kube: the {plural} definition was refused: {said[:500]!r}")

    def served() -> bool:
        status, said = call("/apis/monitoring.coreos.com/v1")
        names = {r["name"] for r in json.loads(said)["resources"]} if status == 200 else set()
        return set(CRDS) <= names

    wait_until("the Prometheus operator's resource definitions", served, 60)


def api_url() -> str:
    return f"https://{HOST}:{KUBE_PORT}"


def write_kubeconfig() -> None:
    KUBECONFIG.write_text(
        "apiVersion: v1\nkind: Config\n"
        "clusters:\n- name: outbox-test\n  cluster:\n"
        f"    server: {api_url()}\n"
        f"    certificate-authority: {CERTS / 'apiserver.crt'}\n"
        "users:\n- name: admin\n  user:\n"
        f"    token: {TOKEN}\n"
        "contexts:\n- name: outbox-test\n  context: {cluster: outbox-test, user: admin}\n"
        "current-context: outbox-test\n"
    )
    KUBECONFIG.chmod(0o600)  # helm warns of a kubeconfig others may read


def up() -> None:
    if pid_of("kube-apiserver") and pid_of("etcd") and api_ready():
        install_crds()  # a start whose installing failed left the server without them
        log(f"kube-apiserver already running on {api_url()}")
        return
    down()
    reserve_ports(KUBE_PORT, ETCD_PORT, ETCD_PORT + 1)
    for port, setting in (
        (KUBE_PORT, "OUTBOX_KUBE_PORT"),
        (ETCD_PORT, "OUTBOX_ETCD_PORT"),
        (ETCD_PORT + 1, "OUTBOX_ETCD_PORT"),
    ):
        if port_open(port):
            fail(f"port {port} is taken by another process; set {setting}")
    build()
    shutil.rmtree(KUBE_DIR / "etcd-data", ignore_errors=True)  # each start begins empty
    KUBE_DIR.mkdir(parents=True, exist_ok=True)
    sa_key = KUBE_DIR / "service-account.key"
    if not sa_key.exists():
        if shutil.which("openssl") is None:
            fail("kube: openssl is needed to make the service-account signing key")
        run(["openssl", "genrsa", "-out", str(sa_key), "2048"], capture_output=True)
    tokens = KUBE_DIR / "tokens.csv"
    tokens.write_text(f"{TOKEN},outbox-test,outbox-test,system:masters\n")
    client, peer = f"http://{HOST}:{ETCD_PORT}", f"http://{HOST}:{ETCD_PORT + 1}"
    start(
        "etcd",
        [
            str(ETCD),
            f"--data-dir={KUBE_DIR / 'etcd-data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--unsafe-no-fsync",  # test data, thrown away at the next start
            "--log-level=warn",
        ],
    )
    apiserver = start(
        "kube-apiserver",
        [
            str(APISERVER),
            f"--etcd-servers={client}",
            f"--bind-address={HOST}",
            f"--advertise-address={HOST}",
            # the `kubernetes` Service's endpoints: refused on loopback, and nothing here uses them
            "--endpoint-reconciler-type=none",
            f"--secure-port={KUBE_PORT}",
            f"--cert-dir={CERTS}",
            f"--token-auth-file={tokens}",
            "--authorization-mode=AlwaysAllow",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={sa_key}",
            f"--service-account-signing-key-file={sa_key}",
            "--service-cluster-ip-range=10.96.0.0/16",
        ],
    )
    log_file = KUBE_DIR / "kube-apiserver.log"

    def ready() -> bool:
        if apiserver.poll() is not None:
            tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-15:])
            fail(f"kube-apiserver exited with {apiserver.returncode}:\n{tail}")
        return api_ready()

    wait_until("kube-apiserver", ready, 120, log_file)
    write_kubeconfig()
    install_crds()
    log(f"kube-apiserver {KUBE_VERSION} ready on {api_url()} (logs: {KUBE_DIR})")


def down() -> None:
    for name in ("kube-apiserver", "etcd"):
        pid = pid_of(name)
        if pid is None:
            continue
        terminate(pid, lambda: pid_of(name), 30)  # noqa: B023 (called before the next turn)
        (KUBE_DIR / f"{name}.pid").unlink(missing_ok=True)
        log(f"{name} stopped")


def main(argv: list[str]) -> int:
    cmd = argv[1] if len(argv) > 1 else "help"
    if cmd == "up":
        up()
        print(f"KUBECONFIG={KUBECONFIG}")
        return 0
    if cmd == "down":
        down()
        return 0
    if cmd == "build":  # only the binaries (make test starts it early, in the background)
        build()
        return 0
    if cmd == "status":
        ok = bool(pid_of("kube-apiserver")) and api_ready()
        print(f"kube      {'up' if ok else 'down':4}  {api_url()}  logs {KUBE_DIR}")
        return 0 if ok else 1
    print(__doc__)
    return 0 if cmd in ("help", "-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
