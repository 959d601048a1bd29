"""The container images of helm/Dockerfile, built and run here for the image tests.

Usage: scripts/image.py build sidecar|reconcile   (prints ENGINE=, RUN_OPTIONS= and IMAGE=)

An image already built from the same Dockerfile and context files (a digest in its label) is not
built again; one build at a time (a lock), so the tests wait for the build `make test` starts.

With a Docker engine (a developer's laptop) `docker build` builds them as written. Without one
(this machine, CI) podman builds them, from Debian's packages: its base images cannot be pulled
(no registry of images is reachable), so stand-ins of the same names are made with debootstrap:
Debian bookworm with Debian's Python 3.11 and pip for `python:3.11-slim` and
`python:3.11-slim-bookworm` (the first is trixie now: its C library is newer), and bookworm with
Debian's Maven and JDK 17 for `maven:3.9-eclipse-temurin-17`. Every step of the Dockerfile runs as
written on them: the package's wheels resolved from constraints.txt, the `--no-index` install,
Debian's Java for the reconciliation, the connector jars by Maven, the user, the entrypoint.
What differs is the base's own Python build.

The stand-ins live in a container storage of our own (`.local/images`), never the machine's,
where they would shadow the real images. The machine's own CAs (/usr/local/share/ca-certificates)
go into them, as a network that inspects TLS needs. podman runs with runc and cgroupfs, and lowered
ulimits: the machine's sandbox may not raise them. Needs root (debootstrap, chroot).
Only the standard library is used, as in services.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from services import LOCAL, ROOT, apt_get, build_lock, fail, log, run

STORE = LOCAL / "images"
DOCKERFILE = ROOT / "helm" / "Dockerfile"
IGNORE_FILE = ROOT / "helm" / "Dockerfile.dockerignore"
DIGEST_LABEL = "org.outbox.test.context"  # what the image was built from: see context_digest
TARGETS = {"sidecar": "outbox-sidecar", "reconcile": "outbox-reconcile"}
# The stand-ins: the names the Dockerfile's FROM lines give, and what each has of Debian's
STAND_INS = {
    "python": (
        ("docker.io/library/python:3.11-slim", "docker.io/library/python:3.11-slim-bookworm"),
        ("python3", "python3-pip", "python3-venv", "ca-certificates"),
    ),
    "maven": (
        ("docker.io/library/maven:3.9-eclipse-temurin-17",),
        ("maven", "openjdk-17-jdk-headless", "ca-certificates"),
    ),
}
# ulimits the sandbox lets a container set (it may not raise them to podman's defaults)
ULIMITS = ("--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096")


def docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def podman() -> list[str]:
    return [
        "podman",
        f"--root={STORE / 'storage'}",
        f"--runroot={STORE / 'run'}",
        "--storage-driver=vfs",  # no overlay mounts needed
        "--runtime=runc",
        "--cgroup-manager=cgroupfs",
    ]


def engine() -> list[str]:
    return ["docker"] if docker_answers() else podman()


def install_tools() -> None:
    missing = [
        package
        for tool, package in (
            ("podman", "podman"),
            ("runc", "runc"),
            ("debootstrap", "debootstrap"),
        )
        if shutil.which(tool) is None
    ]
    if not missing:
        return
    if os.geteuid() != 0:
        fail(f"the image tests need root, and {' '.join(missing)} (apt-get install them)")
    log(f"installing {' '.join(missing)} from Debian's packages")
    apt_get([], "update", "-q")
    apt_get([], "install", "-y", "-q", *missing)


def debian_mirror() -> str:
    """A Debian mirror with bookworm: OUTBOX_DEBIAN_MIRROR, else the first of this machine's
    apt sources (one-line or deb822, `mirror+file:` lists read) whose bookworm Release file says
    Origin: Debian. A vendor's repository, or Ubuntu's, is passed over; any Debian release on
    the host will do, as long as its mirror has bookworm too."""
    if os.environ.get("OUTBOX_DEBIAN_MIRROR"):
        return os.environ["OUTBOX_DEBIAN_MIRROR"]
    listed = Path("/etc/apt/sources.list.d")
    sources = [Path("/etc/apt/sources.list"), *listed.glob("*.list"), *listed.glob("*.sources")]
    uris: list[str] = []
    for source in sources:
        if source.is_file():
            text = source.read_text()
            uris += re.findall(r"^\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)", text, re.MULTILINE)
            for field in re.findall(r"^URIs:\s*(.+)$", text, re.MULTILINE):
                uris += field.split()
    for uri in dict.fromkeys(uris):  # in order, once each
        for mirror in _mirror_list(uri):
            if _has_debian_bookworm(mirror):
                return mirror
    fail("no Debian mirror with bookworm in this machine's apt sources: set OUTBOX_DEBIAN_MIRROR")
    raise AssertionError  # unreachable: fail exits


def _mirror_list(uri: str) -> list[str]:
    if uri.startswith("mirror+file:"):
        listing = Path(uri.removeprefix("mirror+file:"))
        return [line.split()[0] for line in listing.read_text().splitlines() if line.strip()]
    return [uri] if uri.startswith(("http://", "https://")) else []


def _has_debian_bookworm(mirror: str) -> bool:
    release = f"{mirror.rstrip('/')}/dists/bookworm/Release"
    try:
        with urllib.request.urlopen(release, timeout=10) as reply:  # noqa: S310 (http(s) only)
            head = reply.read(4096).decode(errors="replace")
    except OSError:
        return False
    return bool(re.search(r"^Origin: Debian$", head, re.MULTILINE))


def has_image(name: str) -> bool:
    return subprocess.run([*podman(), "image", "exists", name]).returncode == 0


def stand_in(kind: str) -> None:
    names, packages = STAND_INS[kind]
    if all(has_image(name) for name in names):
        return
    rootfs = STORE / f"rootfs-{kind}"
    if rootfs.exists():  # an earlier run's, cut short
        shutil.rmtree(rootfs)
    log(f"making the stand-in for {names[0]} with debootstrap (a minute or two, once)")
    local_cas = Path("/usr/local/share/ca-certificates")
    ca_dest = rootfs / local_cas.relative_to("/")
    # In a mount namespace of their own: the /proc and /sys that debootstrap and Java's CA hook
    # need are gone with it, however the build ends (a kill skips their own unmounting).
    script = (
        'debootstrap --variant=minbase --include="$1" bookworm "$2" "$3" >/dev/null'
        ' && { [ ! -d "$4" ] || cp -r "$4/." "$5/"; }'
        ' && mount -t proc proc "$2/proc"'
        # the CA bundle, and Java's keystore when a JDK is in (its hook runs Java)
        ' && chroot "$2" update-ca-certificates >/dev/null 2>&1'
    )
    run(
        [
            "unshare",
            "--mount",
            "--propagation=private",
            "sh",
            "-c",
            script,
            "stand-in",
            ",".join(packages),
            str(rootfs),
            debian_mirror(),
            str(local_cas),
            str(ca_dest),
        ]
    )
    if kind == "python":
        # as the official image has them: `python`, `pip`, and pip free to install as root
        for name, target in (("python", "python3"), ("pip", "pip3")):
            if not (rootfs / "usr/bin" / name).exists():
                (rootfs / "usr/bin" / name).symlink_to(target)
        (rootfs / "usr/lib/python3.11/EXTERNALLY-MANAGED").unlink(missing_ok=True)
    tar = STORE / f"rootfs-{kind}.tar"
    run(["tar", "--one-file-system", "-C", str(rootfs), "-cf", str(tar), "."])
    shutil.rmtree(rootfs)
    path = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    changes = ["--change", f"ENV {path}", "--change", "ENV LANG=C.UTF-8"]
    run([*podman(), "import", *changes, str(tar), names[0]], capture_output=True)
    tar.unlink()
    for name in names[1:]:
        run([*podman(), "tag", names[0], name])


def context_digest(target: str, root: Path = ROOT) -> str | None:
    """A digest of what `target` is built from: the Dockerfile, its ignore file and every file
    under the paths that file lets into the context. None when the ignore file is not the
    allow-list this reads (its first pattern `*`): then the image is always built."""
    dockerfile = root / DOCKERFILE.relative_to(ROOT)
    ignore_file = root / IGNORE_FILE.relative_to(ROOT)
    patterns = [
        line.strip()
        for line in ignore_file.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if patterns[:1] != ["*"]:
        return None
    files = [dockerfile, ignore_file]
    for pattern in patterns[1:]:
        if pattern.startswith("!"):
            for found in sorted(root.glob(pattern[1:])):
                files += sorted(found.rglob("*")) if found.is_dir() else [found]
    digest = hashlib.sha256(target.encode())
    for path in files:
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(f"\0{path.relative_to(root)}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def built_from(command: list[str], image: str) -> str:
    """The context digest `image` was labelled with: empty if none, or no such image."""
    label = f'{{{{ index .Config.Labels "{DIGEST_LABEL}" }}}}'
    found = subprocess.run(
        [*command, "image", "inspect", "--format", label, image], capture_output=True, text=True
    )
    return found.stdout.strip() if found.returncode == 0 else ""


def build(target: str) -> str:
    """Build `target`'s image, unless one built from the same context is there: `make test`
    builds both in the background while the other tests run, the image tests wait for it (the
    lock) and find them built."""
    with build_lock("images"):
        return _build(target)


def _build(target: str) -> str:
    image = f"localhost/{TARGETS[target]}:test"
    command = engine()
    if command[0] != "docker" and shutil.which("podman") is None:
        install_tools()  # before asking podman for the image: a new machine lacks it
    digest = context_digest(target)
    if digest and built_from(command, image) == digest:
        log(f"{image} is built from this context already")
        return image
    labels = ["--label", f"{DIGEST_LABEL}={digest}"] if digest else []
    if command[0] == "docker":
        build_args: list[str] = []
    else:
        install_tools()  # runc and debootstrap too
        STORE.mkdir(parents=True, exist_ok=True)
        stand_in("python")
        if target == "reconcile":
            stand_in("maven")
        build_args = ["--isolation=chroot", "--network=host", "--pull=never", "--layers=false"]
        # BuildKit finds it beside the Dockerfile by itself
        build_args += [*ULIMITS, f"--ignorefile={IGNORE_FILE}"]
    stage = ["--target", "reconcile"] if target == "reconcile" else []
    log(f"building {image} from {DOCKERFILE.relative_to(ROOT)}")
    STORE.mkdir(parents=True, exist_ok=True)
    build_log = STORE / f"build-{target}.log"
    build_command = [*command, "build", *build_args, *stage, *labels, "-f", str(DOCKERFILE)]
    with build_log.open("w") as out:
        done = subprocess.run(
            [*build_command, "-t", image, str(ROOT)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    if done.returncode != 0:
        tail = "\n".join(build_log.read_text(errors="replace").splitlines()[-30:])
        fail(f"building {image} failed (log: {build_log}):\n{tail}")
    if command[0] != "docker":  # the image this one replaced: our storage's, not a user's
        run([*command, "image", "prune", "--force"], capture_output=True)
    return image


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "build" and argv[2] in TARGETS:
        image = build(argv[2])
        command = engine()
        print(f"ENGINE={json.dumps(command)}")
        # what `run` needs of this engine beyond a container's own options
        print(f"RUN_OPTIONS={json.dumps([] if command[0] == 'docker' else list(ULIMITS))}")
        print(f"IMAGE={image}")
        return 0
    print(__doc__)
    return 0 if argv[1:] in ([], ["help"], ["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
