"""The chart against a real Kubernetes API server (scripts/kube.py): what it renders is admitted
as a cluster would admit it, and helm installs, upgrades and uninstalls it there. No pod runs
(the server has no controllers and no nodes): images and containers are not tested here."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.helm import CHART, app_chart, pod_specs, render
from tests.fixtures.kube import KubeApi

RECONCILE = (
    "reconcile.enabled=true",
    "reconcile.existingSecret=orders-reconciler",
    "reconcile.bootstrapServers=kafka:9092",
    "reconcile.topics=orders.created",
)
# Every optional part on, with values of each shape the chart copies into its objects
EVERYTHING = (
    "existingSecret=orders-outbox",
    "serviceMonitor.enabled=true",
    "prometheusRule.enabled=true",
    'prometheusRule.matchers=namespace="orders"',
    "prometheusRule.labels.release=prometheus",
    "grafanaDashboard.enabled=true",
    "grafanaDashboard.annotations.grafana_folder=Outbox",
    "imagePullSecrets[0].name=registry",
    "env.OUTBOX_LOG_LEVEL=DEBUG",
    "podAnnotations.team=payments",
    "nodeSelector.disktype=ssd",
    "tolerations[0].key=dedicated",
    "tolerations[0].operator=Exists",
    "affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight=1",
    "affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]"
    ".podAffinityTerm.topologyKey=kubernetes.io/hostname",
    *RECONCILE,
    "reconcile.kafkaConfigSecret.name=orders-kafka",
    "reconcile.kafkaOptions.security\\.protocol=SASL_SSL",
    "reconcile.extraArgs={--findings-retention,90d}",
)
# Helm's longest release name (53 characters): the names the chart derives from it must still
# fit Kubernetes' limits (63 for a Job, whose name becomes a label; 52 for a CronJob)
LONGEST_RELEASE = "payments-ledger-reconciliation-production-eu-west-one"


@pytest.mark.parametrize(
    ("release", "values"),
    [
        pytest.param("orders", ("existingSecret=orders-outbox",), id="defaults"),
        pytest.param("orders", ("existingSecret=orders-outbox", "mode=sidecar"), id="sidecar"),
        pytest.param(
            "orders",
            (
                "existingSecret=orders-outbox",
                "mode=sidecar",
                "podMonitor.enabled=true",
                "podMonitor.selector.app=orders",
                "prometheusRule.enabled=true",
            ),
            id="sidecar-monitored",
        ),
        pytest.param("orders", EVERYTHING, id="everything"),
        pytest.param(
            "orders",
            (*EVERYTHING, "reconcile.mode=schedule", "reconcile.activeDeadlineSeconds=1800"),
            id="scheduled",
        ),
        pytest.param(LONGEST_RELEASE, EVERYTHING, id="longest-release"),
        pytest.param(
            LONGEST_RELEASE, (*EVERYTHING, "reconcile.mode=schedule"), id="longest-scheduled"
        ),
        # Helm allows dots in a release name, Kubernetes none in a Service's name; and a cut
        # name that ends in one (the 46th character here) must not keep it before its hash
        pytest.param(
            "a" * 45 + ".eu-west", (*EVERYTHING, "reconcile.mode=schedule"), id="dotted-release"
        ),
        # the reconciliation's own Service (its metrics) from such a name
        pytest.param("a" * 45 + ".eu-west", EVERYTHING, id="dotted-release-continuous"),
    ],
)
def test_the_api_server_admits_every_object_the_chart_renders(
    kube: KubeApi, helm: str, release: str, values: tuple[str, ...]
) -> None:
    """Each object, the migration hook's Job included, passes the server's validation and
    admission with unknown fields refused (a misspelt or misplaced field is an error, not
    silently dropped as `kubectl apply` would drop it)."""
    namespace = kube.namespace()
    docs = render(helm, *values, release=release)
    refused = {}
    for doc in docs:
        status, said = kube.create(doc, namespace, dry_run=True)
        if status != 201:
            refused[f"{doc['kind']}/{doc['metadata']['name']}"] = said.get("message", said)
    assert not refused
    assert docs


def test_the_api_server_admits_an_application_running_the_sidecar_in_its_pods(
    kube: KubeApi, helm: str, tmp_path: Path
) -> None:
    """The sidecar mode's container and volumes, included into an application's Deployment."""
    namespace = kube.namespace()
    docs = [
        *render(helm, chart=app_chart(helm, tmp_path)),
        *render(helm, chart=app_chart(helm, tmp_path, native=True)),  # an init container
    ]
    assert "Deployment" in {d["kind"] for d in docs}
    kept = []
    for doc in docs:
        status, said = kube.create(doc, namespace, dry_run=True)
        assert status == 201, (doc["kind"], said.get("message", said))
        if doc["kind"] == "Deployment":
            pod = said["spec"]["template"]["spec"]
            kept += [c.get("restartPolicy") for c in pod.get("initContainers", [])]
    # a server without native sidecars drops the field, and the pod never leaves Init
    assert kept == ["Always"]


def test_every_pod_the_chart_makes_is_admitted_where_pod_security_is_restricted(
    kube: KubeApi, helm: str, tmp_path: Path
) -> None:
    """Without a seccomp profile, a namespace enforcing `restricted` refused every pod, the
    migration hook's first, and `helm install` timed out. The server runs no controllers: each
    pod template goes in as the Pod a controller would make of it, which Pod Security judges."""
    namespace = kube.namespace({"pod-security.kubernetes.io/enforce": "restricted"})
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}
    status, said = kube.create(account, namespace, dry_run=False)  # a controller's, elsewhere
    assert status == 201, said
    rendered = [
        *render(helm, *EVERYTHING),
        *render(helm, *EVERYTHING, "reconcile.mode=schedule"),
        *render(helm, chart=app_chart(helm, tmp_path)),
    ]
    pods = pod_specs(rendered)
    # the application's pod, without its own container: the sidecar's context alone must do
    pods["Deployment/app"]["containers"] = [
        c for c in pods["Deployment/app"]["containers"] if c["name"] != "app"
    ]
    assert {name.split("/")[0] for name in pods} == {"Deployment", "Job", "CronJob"}
    refused = {}
    for i, (name, pod) in enumerate(sorted(pods.items())):
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"pod-{i}"}, "spec": pod}
        status, said = kube.create(body, namespace, dry_run=True)
        if status != 201:
            refused[name] = said.get("message", said)
    assert not refused


def _helm(helm: str, kube: KubeApi, *args: str) -> str:
    done = subprocess.run(
        [helm, *args],
        text=True,
        capture_output=True,
        env={**os.environ, "KUBECONFIG": str(kube.kubeconfig)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _kinds(kube: KubeApi, namespace: str) -> dict[str, dict[str, str]]:
    kinds: dict[str, dict[str, str]] = {}
    for api_version, kind in [
        ("apps/v1", "Deployment"),
        ("batch/v1", "CronJob"),
        ("v1", "PersistentVolumeClaim"),
        ("v1", "ConfigMap"),
        ("v1", "Service"),
        ("policy/v1", "PodDisruptionBudget"),
        ("monitoring.coreos.com/v1", "PrometheusRule"),
    ]:
        found = kube.names(api_version, kind, namespace)
        found.pop("kube-root-ca.crt", None)  # every namespace's, not the chart's
        if found:
            kinds[kind] = found
    return kinds


def test_helm_installs_upgrades_and_uninstalls_the_chart_keeping_the_checkpoint(
    kube: KubeApi, helm: str
) -> None:
    """A real install, an upgrade that moves the reconciliation from a Deployment to a CronJob
    and turns the alert rules on, and an uninstall, each applied by helm to the server. The
    reconciliation's checkpoint claim is the same object throughout and outlives the release."""
    namespace = kube.namespace()
    base = ("--namespace", namespace, "--set", "existingSecret=orders-outbox")
    reconcile = [a for s in RECONCILE for a in ("--set", s)]
    # the migration hook waits for its Job to finish, and no controller runs one here; the
    # Job itself is admitted by the test above
    _helm(helm, kube, "install", "orders", str(CHART), *base, *reconcile, "--no-hooks")
    installed = _kinds(kube, namespace)
    assert set(installed["Deployment"]) == {
        "orders-outbox-sidecar",
        "orders-outbox-sidecar-reconcile",
    }
    assert "CronJob" not in installed
    assert "PrometheusRule" not in installed
    (claim,) = installed["PersistentVolumeClaim"].items()

    _helm(
        helm,
        kube,
        "upgrade",
        "orders",
        str(CHART),
        *base,
        *reconcile,
        "--no-hooks",
        "--set",
        "reconcile.mode=schedule",
        "--set",
        "replicaCount=3",
        "--set",
        "prometheusRule.enabled=true",
    )
    upgraded = _kinds(kube, namespace)
    assert set(upgraded["Deployment"]) == {"orders-outbox-sidecar"}
    assert set(upgraded["CronJob"]) == {"orders-outbox-sidecar-reconcile"}
    assert set(upgraded["PrometheusRule"]) == {"orders-outbox-sidecar"}
    assert upgraded["PersistentVolumeClaim"] == dict([claim])  # same name, same uid
    status, deployment = kube.call(
        "GET", f"/apis/apps/v1/namespaces/{namespace}/deployments/orders-outbox-sidecar"
    )
    assert status == 200
    assert deployment["spec"]["replicas"] == 3

    _helm(helm, kube, "uninstall", "orders", "--namespace", namespace)
    assert _kinds(kube, namespace) == {"PersistentVolumeClaim": dict([claim])}


def _names(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {d["kind"]: d["metadata"]["name"] for d in docs}


def test_names_cut_to_fit_differ_for_releases_that_share_a_long_prefix(helm: str) -> None:
    """Cut to Kubernetes' limits, two long release names that differ only at their ends (two
    instances of one service, in one namespace) still give objects of different names."""
    one = _names(render(helm, *EVERYTHING, "reconcile.mode=schedule", release=LONGEST_RELEASE))
    two = LONGEST_RELEASE.removesuffix("one") + "two"  # differs past what either name keeps
    two_names = _names(render(helm, *EVERYTHING, "reconcile.mode=schedule", release=two))
    for kind in ("Job", "CronJob"):
        assert one[kind] != two_names[kind], kind
    assert len(one["CronJob"]) <= 52
    assert len(one["Job"]) <= 63
