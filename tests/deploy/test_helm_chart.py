"""The Helm chart, rendered by a real helm, and its contract with the sidecar's settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "outbox-sidecar"


@pytest.fixture(scope="session")
def helm() -> str:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "services.py"), "helm"],
        check=True,
        text=True,
        capture_output=True,
    ).stdout
    return out.strip().splitlines()[-1]


def render(helm: str, *sets: str, chart: Path = CHART) -> list[dict[str, Any]]:
    args = [a for s in sets for a in ("--set", s)]
    out = subprocess.run(
        [helm, "template", "orders", str(chart), *args], check=True, text=True, capture_output=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in docs}


def test_lint(helm: str) -> None:
    lint = subprocess.run(
        [helm, "lint", "--strict", str(CHART), "--set", "existingSecret=s"],
        text=True,
        capture_output=True,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_standalone_runs_relays_with_probes_a_grace_period_and_a_migration_hook(
    helm: str,
) -> None:
    docs = by_kind(render(helm, "existingSecret=orders-outbox", "replicaCount=3"))
    assert set(docs) == {
        "ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "Job",
    }  # fmt: skip
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    assert docs["Deployment"]["spec"]["replicas"] == 3
    (container,) = pod["containers"]
    assert container["args"] == ["run"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["terminationGracePeriodSeconds"] > 25  # above relay.shutdown_grace (PT25S)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["outbox-secrets"]["secret"]["secretName"] == "orders-outbox"
    job = docs["Job"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    selector = docs["Deployment"]["spec"]["selector"]["matchLabels"]
    job_pod = job["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= job_pod.items()  # not one of the relays' pods
    (migrate,) = job["spec"]["template"]["spec"]["containers"]
    assert migrate["command"][:3] == ["outboxctl", "migrate", "--schema"]
    assert not any("dsn" in part.lower() for part in migrate["command"])  # not shown by ps
    assert {"name": "OUTBOX_SECRETS_DIR", "value": "/run/secrets/outbox"} in migrate["env"]


def test_the_rendered_config_and_secret_are_what_the_sidecar_reads(
    helm: str, tmp_path: Path
) -> None:
    docs = by_kind(render(helm, "existingSecret=s", "env.OUTBOX_RELAY__BATCH_SIZE=250"))
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    env = {e["name"]: e["value"] for e in container["env"]}
    # The pod's files, where the container would see them, moved under tmp_path.
    config_dir = tmp_path / mounts["outbox-config"].lstrip("/")
    secrets_dir = tmp_path / mounts["outbox-secrets"].lstrip("/")
    config_dir.mkdir(parents=True)
    secrets_dir.mkdir(parents=True)
    for name, text in docs["ConfigMap"]["data"].items():
        (config_dir / name).write_text(text)
    (secrets_dir / "outbox_database__dsn").write_text("postgresql://relay:pw@db:5432/orders")
    assert env["OUTBOX_CONFIG_FILE"].startswith(mounts["outbox-config"])
    assert env["OUTBOX_SECRETS_DIR"] == mounts["outbox-secrets"]
    env["OUTBOX_CONFIG_FILE"] = str(tmp_path / env["OUTBOX_CONFIG_FILE"].lstrip("/"))
    env["OUTBOX_SECRETS_DIR"] = str(secrets_dir)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    shown = subprocess.run(
        [sys.executable, "-m", "relay.cli", "config"],
        env={**clean, **env},
        cwd=ROOT,
        check=True,
        text=True,
        capture_output=True,
    ).stdout
    settings = json.loads(shown)
    assert settings["kafka"]["bootstrap_servers"] == "kafka:9092"  # from the ConfigMap
    assert settings["relay"]["shards"] == 4
    assert settings["relay"]["batch_size"] == 250  # env wins over the file
    assert settings["http"]["port"] == int(env["OUTBOX_HTTP__PORT"])
    assert settings["database"]["dsn"] == "**********"  # read from the Secret, masked
    assert "pw@" not in shown


def test_sidecar_mode_renders_no_deployment_and_an_app_chart_includes_the_container(
    helm: str, tmp_path: Path
) -> None:
    kinds = by_kind(render(helm, "existingSecret=s", "mode=sidecar"))
    assert set(kinds) == {"ConfigMap", "Job"}
    app = tmp_path / "app"
    (app / "templates").mkdir(parents=True)
    (app / "Chart.yaml").write_text(
        "apiVersion: v2\nname: app\nversion: 1.0.0\ndependencies:\n"
        f"  - name: outbox-sidecar\n    version: 0.1.0\n    alias: outbox\n"
        f"    repository: file://{CHART}\n"
    )
    (app / "values.yaml").write_text("outbox:\n  mode: sidecar\n  existingSecret: app-outbox\n")
    (app / "templates" / "deployment.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: app}\nspec:\n"
        "  selector: {matchLabels: {app: app}}\n  template:\n"
        "    metadata: {labels: {app: app}}\n    spec:\n      containers:\n"
        "        - {name: app, image: app:1}\n"
        '        {{- include "outbox-sidecar.container" .Subcharts.outbox | nindent 8 }}\n'
        "      volumes:\n"
        '        {{- include "outbox-sidecar.volumes" .Subcharts.outbox | nindent 8 }}\n'
    )
    subprocess.run(
        [helm, "dependency", "update", str(app)], check=True, capture_output=True, text=True
    )
    docs = [d for d in render(helm, chart=app) if d["kind"] == "Deployment"]
    (pod,) = [d["spec"]["template"]["spec"] for d in docs]
    assert [c["name"] for c in pod["containers"]] == ["app", "outbox-sidecar"]
    sidecar = pod["containers"][1]
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # a broker outage must not take the application's pod out of its Service
    assert "readinessProbe" not in sidecar
    secrets = [v for v in pod["volumes"] if "secret" in v]
    assert secrets == [{"name": "outbox-secrets", "secret": {"secretName": "app-outbox"}}]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ((), "existingSecret: the name of a Secret with the key outbox_database__dsn"),
        (("existingSecret=s", "mode=daemon"), 'mode must be standalone or sidecar, not "daemon"'),
    ],
)
def test_bad_values_are_refused_with_what_is_wrong(
    helm: str, sets: tuple[str, ...], message: str
) -> None:
    args = [a for s in sets for a in ("--set", s)]
    out = subprocess.run(
        [helm, "template", "orders", str(CHART), *args], text=True, capture_output=True
    )
    assert out.returncode != 0
    assert message in out.stderr
