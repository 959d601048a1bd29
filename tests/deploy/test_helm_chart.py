"""The Helm chart, rendered by a real helm, and its contract with the sidecar's settings."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from relay.http import READY_WITHIN_S
from spark.job import EXIT_FINDINGS
from tests.fixtures.helm import CHART, ROOT, app_chart, pod_specs, render

# The reconciliation's required values; the topics last (refusal tests leave them out)
RECONCILE = (
    "reconcile.existingSecret=orders-reconciler",
    "reconcile.bootstrapServers=kafka:9092",
    "reconcile.topics=orders.created",
)


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in docs}


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("--set", "prometheusRule.enabled=true"),
        ("--set", "reconcile.enabled=true", *(a for s in RECONCILE for a in ("--set", s))),
        tuple(
            a
            for s in [*RECONCILE, "reconcile.enabled=true", "reconcile.kafkaConfigSecret.name=k"]
            for a in ("--set", s)
        ),
        tuple(
            a
            for s in [
                *RECONCILE,
                "reconcile.enabled=true",
                "serviceMonitor.enabled=true",
                "prometheusRule.enabled=true",
                "grafanaDashboard.enabled=true",
            ]
            for a in ("--set", s)
        ),
    ],
)
def test_lint(helm: str, extra: tuple[str, ...]) -> None:
    lint = subprocess.run(
        [helm, "lint", "--strict", str(CHART), "--set", "existingSecret=s", *extra],
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
    # /readyz answers within READY_WITHIN_S, saying what is late, before the kubelet gives up
    assert container["readinessProbe"]["timeoutSeconds"] > READY_WITHIN_S
    assert pod["terminationGracePeriodSeconds"] > 25  # above relay.shutdown_grace (PT25S)
    assert pod["enableServiceLinks"] is False  # Services' OUTBOX_..._SERVICE_HOST and such
    # the Service reaches the container's port by the name it has
    (port,) = docs["Service"]["spec"]["ports"]
    assert port["targetPort"] == container["ports"][0]["name"]
    # an outage makes every relay unready: a node drain must not wait for its end
    assert docs["PodDisruptionBudget"]["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
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


def test_the_migration_job_migrates_the_sidecars_schema_where_its_pods_may_run(
    helm: str,
) -> None:
    """The hook and the sidecar take the schema from one value; the Job's pod gets the
    placement, annotations (a mesh's inject=false) and resources of the relays', and may use
    a Secret of its own (a role owning the schema)."""
    docs = by_kind(
        render(
            helm,
            "existingSecret=orders-outbox",
            "migrations.schema=billing",
            "migrations.existingSecret=orders-outbox-owner",
            "nodeSelector.pool=outbox",
            "tolerations[0].key=dedicated",
            "tolerations[0].operator=Exists",
            "podAnnotations.sidecar\\.istio\\.io/inject=false",
        )
    )
    job_pod = docs["Job"]["spec"]["template"]
    (migrate,) = job_pod["spec"]["containers"]
    assert migrate["command"] == ["outboxctl", "migrate", "--schema", "billing"]
    # ended before Helm's default 5-minute timeout gives up on it, not left running behind
    assert docs["Job"]["spec"]["activeDeadlineSeconds"] == 240
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert {"name": "OUTBOX_DATABASE__SCHEMA_NAME", "value": "billing"} in container["env"]
    assert job_pod["spec"]["volumes"][0]["secret"]["secretName"] == "orders-outbox-owner"
    relays = docs["Deployment"]["spec"]["template"]["spec"]
    assert relays["volumes"][1]["secret"]["secretName"] == "orders-outbox"  # theirs unchanged
    assert job_pod["spec"]["nodeSelector"] == {"pool": "outbox"}
    assert job_pod["spec"]["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    assert job_pod["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}  # text
    relay_annotations = docs["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert relay_annotations["sidecar.istio.io/inject"] == "false"
    assert migrate["resources"] == container["resources"]


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
    # read from the Secret, its password masked
    dsn = "host=db port=5432 dbname=orders user=relay password=**********"
    assert settings["database"]["dsn"] == dsn
    assert "pw@" not in shown


def test_numbers_and_maps_of_a_values_file_reach_the_pods_as_written(
    helm: str, tmp_path: Path
) -> None:
    """Helm reads a values file's numbers as floats: a million or more was rendered as
    3.3554432e+07, which the sidecar's settings and Kafka's parser refuse, and a map as
    map[linger.ms:5]."""
    values = tmp_path / "values.yaml"
    values.write_text(
        "existingSecret: s\n"
        "env:\n"
        "  OUTBOX_RELAY__BATCH_MAX_BYTES: 33554432\n"
        "  OUTBOX_RELAY__CLAIM_AHEAD: false\n"
        "  OUTBOX_KAFKA__EXTRA: {linger.ms: 5}\n"
        "podAnnotations: {example.com/budget: 2000000}\n"
        "reconcile:\n"
        "  enabled: true\n"
        "  kafkaOptions: {fetch.max.bytes: 52428800}\n"
    )
    docs = render(helm, *RECONCILE, values=values)
    (relay,) = [d for d in docs if d["metadata"]["name"] == "orders-outbox-sidecar"
                and d["kind"] == "Deployment"]  # fmt: skip
    pod = relay["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["OUTBOX_RELAY__BATCH_MAX_BYTES"] == "33554432"
    assert env["OUTBOX_RELAY__CLAIM_AHEAD"] == "false"
    assert json.loads(env["OUTBOX_KAFKA__EXTRA"]) == {"linger.ms": 5}
    assert pod["metadata"]["annotations"]["example.com/budget"] == "2000000"
    from relay.config import RelaySettings

    assert RelaySettings(batch_max_bytes=env["OUTBOX_RELAY__BATCH_MAX_BYTES"]).batch_max_bytes == (
        33554432
    )
    (reconcile,) = [d for d in docs if d["metadata"]["name"].endswith("-reconcile")
                    and d["kind"] == "Deployment"]  # fmt: skip
    args = reconcile["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "fetch.max.bytes=52428800" in args


def test_a_dashboard_without_labels_renders(helm: str) -> None:
    """`--set grafanaDashboard.labels=null`, the way to drop the default label, broke the YAML."""
    docs = render(helm, "existingSecret=s", "grafanaDashboard.enabled=true",
                  "grafanaDashboard.labels=null")  # fmt: skip
    (dashboard,) = [d for d in docs if d["metadata"]["name"].endswith("-dashboard")]
    assert "grafana_dashboard" not in dashboard["metadata"]["labels"]


@pytest.mark.parametrize("reconcile_mode", ["continuous", "schedule"])
def test_every_pod_meets_pod_securitys_restricted_level(
    helm: str, reconcile_mode: str, tmp_path: Path
) -> None:
    """Without a seccomp profile, a namespace enforcing `restricted` refused every pod: the
    migration hook's first, and `helm install` timed out."""
    docs = render(
        helm, "existingSecret=s", "reconcile.enabled=true", f"reconcile.mode={reconcile_mode}",
        *RECONCILE,
    )  # fmt: skip
    pods = pod_specs(docs)
    assert {name.split("/")[0] for name in pods} == {
        "Deployment", "Job", "CronJob" if reconcile_mode == "schedule" else "Deployment",
    }  # fmt: skip
    for name, pod in pods.items():
        assert pod["automountServiceAccountToken"] is False, name  # nothing calls the API
        for container in pod["containers"]:
            own = container["securityContext"]
            context = {**pod["securityContext"], **own}
            assert context["runAsNonRoot"] is True, name
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
            assert own["allowPrivilegeEscalation"] is False, name
            assert own["capabilities"]["drop"] == ["ALL"], name
    # sidecar mode: in the application's pod, the container's own context says it all
    app = [d for d in render(helm, chart=app_chart(helm, tmp_path)) if d["kind"] == "Deployment"]
    (pod,) = pod_specs(app).values()
    sidecar = pod["containers"][1]["securityContext"]
    assert sidecar["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sidecar["runAsNonRoot"] is True


def test_an_app_chart_runs_the_sidecar_as_a_native_one_that_outlives_the_application(
    helm: str, tmp_path: Path
) -> None:
    """Among the init containers with restartPolicy Always, Kubernetes stops it after the
    application's containers: as a plain container it got SIGTERM with the application, and
    the rows the application committed while it drained waited for another pod's relay."""
    docs = render(helm, chart=app_chart(helm, tmp_path, native=True))
    (pod,) = pod_specs([d for d in docs if d["kind"] == "Deployment"]).values()
    assert [c["name"] for c in pod["containers"]] == ["app"]
    (sidecar,) = pod["initContainers"]
    assert (sidecar["name"], sidecar["restartPolicy"]) == ("outbox-sidecar", "Always")
    plain = render(helm, chart=app_chart(helm, tmp_path))
    (plain_pod,) = pod_specs([d for d in plain if d["kind"] == "Deployment"]).values()
    assert {**sidecar, "restartPolicy": None} == {
        **plain_pod["containers"][1],
        "restartPolicy": None,
    }


def test_sidecar_mode_renders_no_deployment_and_an_app_chart_includes_the_container(
    helm: str, tmp_path: Path
) -> None:
    kinds = by_kind(render(helm, "existingSecret=s", "mode=sidecar"))
    assert set(kinds) == {"ConfigMap", "Job"}
    app = app_chart(helm, tmp_path)
    docs = [d for d in render(helm, chart=app) if d["kind"] == "Deployment"]
    (pod,) = [d["spec"]["template"]["spec"] for d in docs]
    assert [c["name"] for c in pod["containers"]] == ["app", "outbox-sidecar"]
    sidecar = pod["containers"][1]
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "outbox-http"}
    # a broker outage must not take the application's pod out of its Service
    assert "readinessProbe" not in sidecar
    # nor a part that stopped on something that cannot work: the sidecar stays up, retrying
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    assert env["OUTBOX_ON_PART_STOPPED"] == "retry"
    standalone = by_kind(render(helm, "existingSecret=s"))["Deployment"]
    (relay,) = standalone["spec"]["template"]["spec"]["containers"]
    assert "OUTBOX_ON_PART_STOPPED" not in {e["name"] for e in relay["env"]}  # exits, restarted
    (given,) = [  # the application's choice wins, as one variable, not two
        d for d in render(helm, "outbox.env.OUTBOX_ON_PART_STOPPED=exit", chart=app)
        if d["kind"] == "Deployment"
    ]  # fmt: skip
    chosen = given["spec"]["template"]["spec"]["containers"][1]["env"]
    assert [e["value"] for e in chosen if e["name"] == "OUTBOX_ON_PART_STOPPED"] == ["exit"]
    (in_config,) = [  # and so does its config's, which the chart's variable would override
        d for d in render(helm, 'outbox.config=on_part_stopped = "exit"', chart=app)
        if d["kind"] == "Deployment"
    ]  # fmt: skip
    env_names = [e["name"] for e in in_config["spec"]["template"]["spec"]["containers"][1]["env"]]
    assert "OUTBOX_ON_PART_STOPPED" not in env_names
    secrets = [v for v in pod["volumes"] if "secret" in v]
    assert secrets == [{"name": "outbox-secrets", "secret": {"secretName": "app-outbox"}}]
    # port names are the pod's: the application's own "http" stays the only one
    names = [p["name"] for c in pod["containers"] for p in c.get("ports", [])]
    assert names == ["http", "outbox-http"]

    def annotations(*sets: str) -> dict[str, str]:
        (deployment,) = [d for d in render(helm, *sets, chart=app) if d["kind"] == "Deployment"]
        return deployment["spec"]["template"]["metadata"]["annotations"]  # type: ignore[no-any-return]

    # the sidecar reads its config once: a changed one rolls the application's pods
    before = annotations()
    assert set(before) == {"checksum/outbox-config"}
    assert annotations("outbox.config=[relay]\nshards = 4") != before
    assert annotations() == before


def test_sidecar_mode_scrapes_the_sidecars_in_the_applications_pods(helm: str) -> None:
    """The relays' ServiceMonitor follows the standalone Deployment's Service: in sidecar mode
    nothing scraped the sidecars, and the alert rules saw no relay at all."""
    docs = by_kind(
        render(
            helm,
            "existingSecret=s",
            "mode=sidecar",
            "podMonitor.enabled=true",
            "podMonitor.selector.app=orders",
        )
    )
    monitor = docs["PodMonitor"]["spec"]
    assert monitor["selector"] == {"matchLabels": {"app": "orders"}}
    (endpoint,) = monitor["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("outbox-http", "/metrics")
    # standalone relays have their ServiceMonitor: no PodMonitor there
    assert "PodMonitor" not in by_kind(render(helm, "existingSecret=s", "podMonitor.enabled=true"))


def _exported_series() -> dict[str, set[str]]:
    """Each series the sidecar (relay and checker) and the reconciliation export, with its
    label names."""
    import checker._metrics
    import relay.metrics
    from spark.config import ReconcileSettings
    from spark.metrics import ReconcileMetrics

    reconcile = ReconcileMetrics(
        ReconcileSettings(
            dsn="postgresql://x", bootstrap_servers="k", topics=("t",), checkpoint="cp"
        )
    )
    series: dict[str, set[str]] = {}
    for module in (relay.metrics, checker._metrics, reconcile):
        for metric in vars(module).values():
            if not isinstance(metric, MetricWrapperBase):
                continue
            labels = set(metric._labelnames)
            if metric._type == "counter":
                series[f"{metric._name}_total"] = labels
            elif metric._type == "histogram":
                series[f"{metric._name}_bucket"] = labels | {"le"}
                series[f"{metric._name}_sum"] = series[f"{metric._name}_count"] = labels
            else:
                series[metric._name] = labels
    return series


def _walk(node: Any, selectors: list[Any], grouped: set[str]) -> None:
    """The vector selectors of a PromQL expression, and the labels it aggregates by."""
    if isinstance(node, promql_parser.VectorSelector):
        selectors.append(node)
    elif isinstance(node, promql_parser.MatrixSelector):
        _walk(node.vector_selector, selectors, grouped)
    elif isinstance(node, promql_parser.AggregateExpr):
        grouped.update(node.modifier.labels if node.modifier else ())
        _walk(node.expr, selectors, grouped)
    elif isinstance(node, promql_parser.BinaryExpr):
        _walk(node.lhs, selectors, grouped)
        _walk(node.rhs, selectors, grouped)
    elif isinstance(node, promql_parser.Call):
        for arg in node.args:
            _walk(arg, selectors, grouped)
    elif isinstance(
        node, promql_parser.ParenExpr | promql_parser.UnaryExpr | promql_parser.SubqueryExpr
    ):
        _walk(node.expr, selectors, grouped)


def _aggregations(node: Any) -> list[Any]:
    """The aggregations of a PromQL expression, outermost first."""
    found = [node] if isinstance(node, promql_parser.AggregateExpr) else []
    children: list[Any] = []
    if isinstance(node, promql_parser.BinaryExpr):
        children = [node.lhs, node.rhs]
    elif isinstance(node, promql_parser.Call):
        children = list(node.args)
    elif isinstance(
        node,
        promql_parser.AggregateExpr
        | promql_parser.ParenExpr
        | promql_parser.UnaryExpr
        | promql_parser.SubqueryExpr,
    ):
        children = [node.expr]
    for child in children:
        found += _aggregations(child)
    return found


def test_alert_rules_are_off_by_default(helm: str) -> None:
    kinds = {d["kind"] for d in render(helm, "existingSecret=s")}
    assert "PrometheusRule" not in kinds


RECONCILE_ALERTS = {"OutboxReconcileFindings", "OutboxReconcileStalled"}


@pytest.mark.parametrize("mode", ["standalone", "sidecar"])
def test_alert_rules_use_only_series_and_labels_the_sidecar_exports(helm: str, mode: str) -> None:
    """Each rule's expression parses as PromQL; every selector names a series the relay, the
    checker or the reconciliation exports and carries the configured matchers; it aggregates
    only by their labels. A metric renamed in the code fails here, not silently in someone's
    Prometheus."""
    docs = by_kind(
        render(
            helm,
            "existingSecret=s",
            f"mode={mode}",
            "prometheusRule.enabled=true",
            'prometheusRule.matchers=namespace="orders"',
            "prometheusRule.labels.release=prom",
            "prometheusRule.deliveryLagSeconds=120",
            "prometheusRule.reconcileStalledSeconds=600",
            "reconcile.enabled=true",
            "serviceMonitor.enabled=true",  # the job is scraped: its series' absence is said
            "podMonitor.enabled=true",  # so are the sidecars (mode=sidecar)
            "podMonitor.selector.app=orders",
            *RECONCILE,
        )
    )
    rule = docs["PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "prom"
    rules = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    assert "OutboxDeliveryLagging" in rules
    assert rules["OutboxDeliveryLagging"]["expr"].endswith("> 120")
    assert rules.keys() >= RECONCILE_ALERTS
    assert "> 600 or label_replace(absent(" in rules["OutboxReconcileStalled"]["expr"]
    assert "absent(outbox_relay_shards_owned" in rules["OutboxShardsUnowned"]["expr"]
    assert "outbox_sidecar_part_stopped" in rules["OutboxSidecarPartStopped"]["expr"]
    exported = _exported_series()
    for name, r in rules.items():
        _assert_exported(
            name, r["expr"], exported, ("namespace", "orders"), frozenset({"namespace", "pod"})
        )
        assert r["labels"]["severity"] == "warning"
        assert r["annotations"]["summary"]


def test_alert_rules_judge_the_releases_namespace_and_say_it_by_default(helm: str) -> None:
    """With no matchers, each release's rules judged every outbox's series in the cluster at
    once (another release's owned shards hid this one's unowned), and aggregated the namespace
    away, so an alert could not be routed by it."""
    docs = by_kind(
        render(helm, "existingSecret=s", "prometheusRule.enabled=true", "reconcile.enabled=true",
               *RECONCILE)  # in helm template's namespace, default
    )  # fmt: skip
    rules = {r["alert"]: r for g in docs["PrometheusRule"]["spec"]["groups"] for r in g["rules"]}
    for name, r in rules.items():
        tree = promql_parser.parse(r["expr"])
        selectors: list[Any] = []
        _walk(tree, selectors, set())
        for selector in selectors:
            assert ("namespace", "default") in {
                (m.name, m.value) for m in selector.matchers.matchers
            }, name
        for aggregation in _aggregations(tree):
            assert "namespace" in aggregation.modifier.labels, name


@pytest.mark.parametrize(
    ("alert", "fires_on"),
    [
        # an endpoint that hangs: its circuit goes half open for each probe, and back to open
        ("OutboxCheckEndpointDown", "min_over_time("),
        # retried every 30 s a shard: below OutboxRelayErrors' rate
        ("OutboxDeadLetterUnwritable", 'kind="dead_letter_unwritable"'),
        (
            "OutboxCheckerFailing",
            'outbox_checker_rounds_total{namespace="default", result="error"}',
        ),
        # the parkings' alert clears 15 minutes after the last one; the records still wait
        (
            "OutboxParkedRecordsWaiting",
            'outbox_relay_parked_records{namespace="default"}[15m])) > 0',
        ),
        # a loss is one event: an increase, not a rate that must hold for minutes
        ("OutboxRelayLeasesLost", 'change="lost"}[15m])) > 0'),
        ("OutboxDeadLetterCopiesShrunk", 'form!="full"}[15m])) > 0'),
    ],
)
def test_alerts_for_failures_that_flap_or_are_retried_slowly(
    helm: str, alert: str, fires_on: str
) -> None:
    docs = by_kind(render(helm, "existingSecret=s", "prometheusRule.enabled=true"))
    rules = {r["alert"]: r for g in docs["PrometheusRule"]["spec"]["groups"] for r in g["rules"]}
    assert fires_on in rules[alert]["expr"]
    if alert == "OutboxCheckEndpointDown":  # not closed for 10 minutes: half open counts too
        assert ">= 1 and count_over_time(" in rules[alert]["expr"]  # and 10 minutes of it


@pytest.mark.parametrize("given", ["", "10m"])
def test_the_reconciliations_undelivered_deadline_is_passed_when_given(
    helm: str, given: str
) -> None:
    docs = by_kind(render(helm, "existingSecret=s", "reconcile.enabled=true", *RECONCILE,
                          f"reconcile.undeliveredDeadline={given}"))  # fmt: skip
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    if given:
        assert args[args.index("--undelivered-deadline") + 1] == given
    else:  # the job's default, as the lag alert's
        assert "--undelivered-deadline" not in args


def test_reconcile_arguments_that_only_name_a_key_file_are_taken(helm: str) -> None:
    docs = by_kind(render(helm, "existingSecret=s", "reconcile.enabled=true", *RECONCILE,
                          "reconcile.extraArgs={--jdbc-url=jdbc:postgresql://db/app?sslkey="
                          "/certs/key.pem&sslmode=verify-full}"))  # fmt: skip
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert any("sslkey=/certs/key.pem" in arg for arg in container["args"])


def test_a_reconciliation_nobody_scrapes_is_not_alerted_as_absent(helm: str) -> None:
    docs = by_kind(render(helm, "existingSecret=s", "prometheusRule.enabled=true",
                          "reconcile.enabled=true", *RECONCILE))  # fmt: skip
    rules = {r["alert"]: r for g in docs["PrometheusRule"]["spec"]["groups"] for r in g["rules"]}
    assert "absent(" not in rules["OutboxReconcileStalled"]["expr"]


def test_a_release_without_relays_is_not_alerted_for_their_absence(helm: str) -> None:
    docs = by_kind(render(helm, "existingSecret=s", "prometheusRule.enabled=true",
                          "prometheusRule.relaysExpected=false"))  # fmt: skip
    rules = {r["alert"]: r for g in docs["PrometheusRule"]["spec"]["groups"] for r in g["rules"]}
    assert "absent(" not in rules["OutboxShardsUnowned"]["expr"]


@pytest.mark.parametrize(
    "sets", [(), ("reconcile.enabled=true", "reconcile.mode=schedule", *RECONCILE)]
)
def test_the_reconciliation_alerts_only_where_a_running_job_exports_its_metrics(
    helm: str, sets: tuple[str, ...]
) -> None:
    """Without the reconciliation, or with a CronJob of --once runs (no metrics served), its
    alerts would never fire, or the stall alert always would."""
    docs = by_kind(render(helm, "existingSecret=s", "prometheusRule.enabled=true", *sets))
    groups = docs["PrometheusRule"]["spec"]["groups"]
    alerts = {r["alert"] for group in groups for r in group["rules"]}
    assert "OutboxDeliveryLagging" in alerts
    assert not alerts & RECONCILE_ALERTS


# kube-state-metrics' series the scheduled reconciliation's alerts use, and their labels
KUBE_STATE_SERIES = {
    "kube_job_failed": {"namespace", "job_name", "condition"},
    "kube_job_status_start_time": {"namespace", "job_name"},
    "kube_cronjob_status_last_successful_time": {"namespace", "cronjob"},
    "kube_cronjob_created": {"namespace", "cronjob"},
}


def _run_args(cron: dict[str, Any]) -> list[str]:
    """The arguments of a CronJob's run."""
    (container,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    return list(container["args"])


def test_a_scheduled_reconciliation_is_alerted_on_from_its_cronjobs_runs(helm: str) -> None:
    """A CronJob's --once runs export no metrics: its alerts would never fire. Its runs' Jobs
    (named <cronjob>-<minutes>) fail when a run finds something (--fail-on-findings)."""
    sets = ("existingSecret=s", "reconcile.enabled=true", "reconcile.mode=schedule", *RECONCILE)
    docs = by_kind(render(helm, *sets, "prometheusRule.enabled=true"))
    cron = docs["CronJob"]["metadata"]["name"]
    assert "--fail-on-findings" in _run_args(docs["CronJob"])
    (rule,) = docs["CronJob"]["spec"]["jobTemplate"]["spec"]["podFailurePolicy"]["rules"]
    assert rule == {  # not retried: it would judge the same range, and find it again
        "action": "FailJob",
        "onExitCodes": {"containerName": "reconcile", "operator": "In", "values": [EXIT_FINDINGS]},
    }
    rules = {r["alert"]: r for g in docs["PrometheusRule"]["spec"]["groups"] for r in g["rules"]}
    scheduled = {"OutboxReconcileRunFailed", "OutboxReconcileUnsucceeded"}
    assert rules.keys() >= scheduled
    assert not rules.keys() & RECONCILE_ALERTS  # those of a running job's metrics
    for name in scheduled:
        selectors: list[Any] = []
        grouped: set[str] = set()
        _walk(promql_parser.parse(rules[name]["expr"]), selectors, grouped)
        assert not grouped - set().union(*(KUBE_STATE_SERIES[x.name] for x in selectors)), name
        for selector in selectors:
            matchers = {m.name: m for m in selector.matchers.matchers}
            assert matchers["namespace"].value == "default"  # the release's
            if selector.name == "kube_job_failed":  # the Job failed, not one of its pods
                assert matchers["condition"].value == "true"
            if "job_name" in matchers:  # the CronJob's runs, and no other Job
                runs = re.compile(matchers["job_name"].value)
                assert runs.fullmatch(f"{cron}-29412345")
                assert not runs.fullmatch(f"{cron}-x")
                assert not runs.fullmatch("orders-migrate-1")
            else:
                assert matchers["cronjob"].value == cron
    quiet = by_kind(render(helm, *sets, "reconcile.failOnFindings=false"))
    assert "--fail-on-findings" not in _run_args(quiet["CronJob"])
    assert "podFailurePolicy" not in quiet["CronJob"]["spec"]["jobTemplate"]["spec"]
    continuous = by_kind(
        render(helm, *sets, "reconcile.mode=continuous", "prometheusRule.enabled=true")
    )
    groups = continuous["PrometheusRule"]["spec"]["groups"]
    assert not {r["alert"] for g in groups for r in g["rules"]} & scheduled


def _assert_exported(
    name: str,
    expr: str,
    exported: dict[str, set[str]],
    matcher: tuple[str, str],
    target_labels: frozenset[str] = frozenset(),
) -> None:
    """`expr` parses, and each of its selectors names an exported series, carries `matcher`,
    and is aggregated only by that series' labels (or labels Prometheus adds to targets)."""
    selectors: list[Any] = []
    grouped: set[str] = set()
    _walk(promql_parser.parse(expr), selectors, grouped)
    assert selectors, name
    for selector in selectors:
        assert selector.name in exported, f"{name}: {selector.name} is not exported"
        assert matcher in {(m.name, m.value) for m in selector.matchers.matchers}, name
        unknown = grouped - exported[selector.name] - target_labels
        assert not unknown, f"{name}: by {unknown}"


def test_the_dashboard_queries_only_series_and_labels_the_sidecar_exports(helm: str) -> None:
    """The Grafana dashboard's ConfigMap carries the label Grafana's sidecar looks for; every
    panel's query is held to the exported series as the alerting rules are, filtered by the
    dashboard's namespace variable."""
    docs = render(
        helm,
        "existingSecret=s",
        "grafanaDashboard.enabled=true",
        "grafanaDashboard.annotations.grafana_folder=Outbox",
    )
    (configmap,) = [d for d in docs if d["metadata"]["name"].endswith("-dashboard")]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "Outbox"}
    dashboard = json.loads(configmap["data"]["outbox-sidecar.json"])
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "namespace"}
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    exported = _exported_series()
    queried = []
    for panel in (p for p in dashboard["panels"] if p["type"] != "row"):
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "5m")  # Grafana's own variable
            _assert_exported(
                panel["title"],
                expr,
                exported,
                ("namespace", "$namespace"),
                frozenset({"pod", "namespace", "instance", "job"}),
            )
            queried.append(expr)
    assert any("outbox_relay_oldest_undelivered_seconds" in q for q in queried)
    assert any("outbox_relay_parked_records" in q for q in queried)
    assert any("outbox_checker_checks_total" in q for q in queried)
    assert any("outbox_reconcile_findings_total" in q for q in queried)


def test_the_dashboard_is_off_by_default(helm: str) -> None:
    names = [d["metadata"]["name"] for d in render(helm, "existingSecret=s")]
    assert not any(name.endswith("-dashboard") for name in names)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ((), "existingSecret: the name of a Secret with the key outbox_database__dsn"),
        (("existingSecret=s", "mode=daemon"), 'mode must be standalone or sidecar, not "daemon"'),
        (
            ("existingSecret=s", "env.OUTBOX_HTTP__PORT=9090"),
            "env.OUTBOX_HTTP__PORT: the chart sets it from httpPort; set that instead",
        ),
        (
            ("existingSecret=s", "env.outbox_database__schema_name=billing"),
            "env.outbox_database__schema_name: the chart sets it from migrations.schema",
        ),
        (
            ("existingSecret=s", 'config=[database]\nschema_name = "billing"'),
            "config: database.schema_name is set from migrations.schema",
        ),
        *[
            (("existingSecret=s", "reconcile.enabled=true", *RECONCILE[:-1], *more), message)
            for more, message in [
                ((), "reconcile: give the delivered topics as reconcile.topics or"),
                (("reconcile.topics=a", "reconcile.topicPattern=b"), "(one of them)"),
                (("reconcile.topics=a", "reconcile.mode=daily"), "reconcile.mode must be"),
                (("reconcile.topics=a", "reconcile.existingSecret="), "reconcile.existingSecret:"),
                (("reconcile.topics=a", "reconcile.bootstrapServers="), "reconcile.bootstrap"),
            ]
        ],
        *[
            (
                ("existingSecret=s", *more),
                f"terminationGracePeriodSeconds ({given}) must be at least 2 s above "
                f"relay.shutdown_grace ({grace})",
            )
            for more, given, grace in [
                (('config=[relay]\nshutdown_grace = "PT30S"',), 30, "PT30S, 30 s"),
                (("config=[relay]\n  shutdown_grace = 30.5  # s",), 30, "30.5, 30.5 s"),
                (("env.outbox_relay__shutdown_grace=pt1m",), 30, "PT1M, 60 s"),  # env wins
                (("terminationGracePeriodSeconds=20", "config=[kafka]"), 20, "25, 25 s"),
                (("terminationGracePeriodSeconds=26",), 26, "PT25S, 25 s"),  # too little room
                # a comment naming the key is no form of it: the default stands
                (
                    ("terminationGracePeriodSeconds=10", "config=[relay]\n# above shutdown_grace"),
                    10,
                    "25, 25 s",
                ),
                (("config=[relay]\nshutdown_grace = 'PT60S'",), 30, "PT60S, 60 s"),  # TOML's '
                # forms that passed unchecked and outlasted the pod's 30 s (found by a review)
                (('config=[relay]\nshutdown_grace = "P1D"',), 30, "P1D, 86400 s"),
                (("config=relay.shutdown_grace = 60",), 30, "60, 60 s"),
                (('config=relay = {shutdown_grace = "P0DT60S"}',), 30, "P0DT60S, 60 s"),
            ]
        ],
        # the probes reach the sidecar's HTTP server on httpPort at every address: off, or on
        # loopback, the liveness probe restarted the sidecar for ever (found by a review)
        (("existingSecret=s", "env.OUTBOX_HTTP__ENABLED=false"), "env.OUTBOX_HTTP__ENABLED: "),
        (("existingSecret=s", "env.OUTBOX_HTTP__HOST=127.0.0.1"), "env.OUTBOX_HTTP__HOST: "),
        (("existingSecret=s", "config=[http]\nenabled = false"), "config: the http section"),
        (("existingSecret=s", 'config=http.host = "127.0.0.1"'), "config: the http section"),
        # spark-submit refused "%!s(int64=1024)"; a heap near the limit was OOM-killed later
        *[
            (("existingSecret=s", "reconcile.enabled=true", *RECONCILE, more), said)
            for more, said in [
                ("reconcile.driverMemory=1024", "reconcile.driverMemory: give it as a number and"),
                ("reconcile.driverMemory=4g", "reconcile.driverMemory (4g) must be at most 3/4"),
                # the JVM's -Xmx reads a plain number as bytes, and refuses "gb"
                ("reconcile.driverMemory=1gb", "reconcile.driverMemory: give it as a number and"),
                (
                    "reconcile.resources.limits.memory=1.2Gi",
                    "reconcile.driverMemory (1g) must be at most 3/4",
                ),
                ("reconcile.resources.limits.memory=lots", 'limits.memory "lots": give it as'),
            ]
        ],
        # quoted keys are TOML too
        (
            ("existingSecret=s", 'config=[relay]\n"shutdown_grace" = 60'),
            "must be at least 2 s above relay.shutdown_grace (60, 60 s)",
        ),
        (("existingSecret=s", 'config=["http"]\nenabled = false'), "config: the http section"),
        (("existingSecret=s", "config=http = {enabled = false}"), "config: the http section"),
        # a form the chart cannot read: refused, not left unchecked
        (
            ("existingSecret=s", 'config=[relay]\nshutdown_grace = "00:01:00"'),
            'relay.shutdown_grace "00:01:00": give it as seconds or as ISO 8601',
        ),
        *[
            (("existingSecret=s", f"config={config}"), f"config: {key} holds a secret")
            for config, key in [
                ('[database]\ndsn = "postgresql://app:pw@db/app"', "dsn"),
                ('[kafka]\nsasl_password = "pw"', "sasl_password"),
                ('[kafka]\nextra = {"sasl.password" = "pw"}', '"sasl.password"'),
                ('[checker.endpoints.orders]\nsecrets = ["whsec_x"]', "secrets"),
                ('database.dsn = "postgresql://app:pw@db/app"', "dsn"),  # dotted
                ("[kafka]\nextra = {'ssl.key.pem' = 'pem'}", "'ssl.key.pem'"),  # TOML's quotes
            ]
        ],
        (
            ("existingSecret=s", 'env.OUTBOX_KAFKA__EXTRA={"sasl.password": "pw"}'),
            "env.OUTBOX_KAFKA__EXTRA holds a secret",
        ),
        (
            ("existingSecret=s", "env.OUTBOX_KAFKA__SASL_PASSWORD=pw"),
            "env.OUTBOX_KAFKA__SASL_PASSWORD holds a secret, and the pod's spec shows it to "
            "anyone who may read it; put it in the Secret (existingSecret) as the key "
            "outbox_kafka__sasl_password",
        ),
        (
            ("existingSecret=s", "mode=sidecar", "podMonitor.enabled=true"),
            "podMonitor.selector: the labels of the application's pods",
        ),
        # the reconciliation's arguments are its command line, which the pod's spec shows
        *[
            (("existingSecret=s", "reconcile.enabled=true", *RECONCILE, set_), message)
            for set_, message in [
                (
                    r"reconcile.kafkaOptions.sasl\.jaas\.config=x",
                    "reconcile.kafkaOptions.sasl.jaas.config holds a secret",
                ),
                (
                    "reconcile.extraArgs={--dsn,postgresql://u:pw@db/app}",
                    "reconcile.extraArgs: --dsn would show the DSN",
                ),
                (  # argparse takes an abbreviation
                    "reconcile.extraArgs={--ds=postgresql://u:pw@db/app}",
                    "reconcile.extraArgs: --dsn would show the DSN",
                ),
                (  # Java's inline PEM key
                    r"reconcile.kafkaOptions.ssl\.keystore\.key=pem",
                    "reconcile.kafkaOptions.ssl.keystore.key holds a secret",
                ),
                (
                    "reconcile.extraArgs={--kafka-option=sasl.password=pw}",
                    'reconcile.extraArgs: "--kafka-option=sasl.password=..." holds a secret',
                ),
                (
                    "reconcile.extraArgs={--jdbc-url,jdbc:postgresql://db/app?password=pw}",
                    'reconcile.extraArgs: "jdbc:postgresql://db/app?password=..." holds a secret',
                ),
            ]
        ],
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


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("OUTBOX_DATABASE", {"dsn": "postgresql://relay:pw@db/orders"}),
        ("OUTBOX_CHECKER__ENDPOINTS", {"orders": {"url": "http://o/c", "secrets": ["whsec_x"]}}),
        ("OUTBOX_KAFKA", {"sasl_password": "pw"}),
        ("OUTBOX_KAFKA", {"extra": {"ssl.key.password": "pw"}}),
        ("OUTBOX_KAFKA__EXTRA", {"ssl.key.passphrase": "pw"}),
        ("OUTBOX_DATABASE", '{"dsn": "postgresql://relay:pw@db/orders"}'),  # as text
    ],
)
def test_a_secret_in_a_section_given_whole_in_env_is_refused(
    helm: str, name: str, value: Any
) -> None:
    """The sidecar reads a whole section from one variable as JSON, and the chart renders a map
    in `env` as JSON: only variables named like a secret were refused, and these rendered with
    the secret in the pod's spec (found by a review of the chart)."""
    out = subprocess.run(
        [helm, "template", "orders", str(CHART), "--set", "existingSecret=s",
         "--set-json", f"env.{name}={json.dumps(value)}"],
        text=True, capture_output=True,
    )  # fmt: skip
    assert out.returncode != 0
    assert f"env.{name} holds a secret" in out.stderr


def test_a_section_given_whole_in_env_without_a_secret_renders(helm: str) -> None:
    endpoints = {"orders": {"url": "http://o/c", "timeout": "PT5S"}}
    args = [
        "--set",
        "existingSecret=s",
        "--set-json",
        f"env.OUTBOX_CHECKER__ENDPOINTS={json.dumps(endpoints)}",
    ]
    out = subprocess.run(
        [helm, "template", "orders", str(CHART), *args], text=True, capture_output=True
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    "sets",
    [
        ('config=[relay]\nshutdown_grace = "PT28S"',),
        # forms the line's pattern misses: the sidecar's to judge, not taken for the default
        ('config=relay.shutdown_grace = "PT10S"', "terminationGracePeriodSeconds=20"),
        ('config=relay = {shutdown_grace = "PT5S"}', "terminationGracePeriodSeconds=10"),
        ("terminationGracePeriodSeconds=null",),  # Kubernetes' default then
        ('config=[relay]\nshutdown_grace = "PT1M30S"', "terminationGracePeriodSeconds=92"),
        ("env.OUTBOX_RELAY__SHUTDOWN_GRACE=PT5S", 'config=[relay]\nshutdown_grace = "PT1M"'),
        ('config=[relay]\nshutdown_grace = "P0DT1M"', "terminationGracePeriodSeconds=62"),
        ("mode=sidecar", 'config=[relay]\nshutdown_grace = "PT1M"'),  # the application's pod
    ],
)
def test_a_shutdown_grace_the_pods_termination_outlasts_is_taken(
    helm: str, sets: tuple[str, ...]
) -> None:
    assert render(helm, "existingSecret=s", *sets)


def test_a_shutdown_grace_in_the_relay_section_given_whole_in_env_is_held_to_the_period(
    helm: str,
) -> None:
    """OUTBOX_RELAY={"shutdown_grace": 60} was not read, and the pods' 30 s cut the stop short."""
    out = subprocess.run(
        [helm, "template", "orders", str(CHART), "--set", "existingSecret=s",
         "--set-json", 'env.OUTBOX_RELAY={"shutdown_grace": 60, "shards": 2}'],
        text=True, capture_output=True,
    )  # fmt: skip
    assert out.returncode != 0
    assert "terminationGracePeriodSeconds (30) must be at least 2 s above" in out.stderr
    assert "(60, 60 s)" in out.stderr


@pytest.mark.parametrize(
    "config",
    [
        '# dsn = "in the Secret"\n[relay]\nshards = 2',  # a comment
        '[checker.endpoints.orders]\nurl = "https://orders/check?dsn=1"',  # a word of a value
    ],
)
def test_what_only_names_a_secret_setting_is_no_secret(helm: str, config: str) -> None:
    assert render(helm, "existingSecret=s", f"config={config}")


def test_an_image_tag_a_values_file_gives_as_a_number_is_refused(helm: str, tmp_path: Path) -> None:
    """YAML reads 1.10 as 1.1 (and 0123 as 83): the pods would pull another image."""
    values = tmp_path / "values.yaml"
    values.write_text("existingSecret: s\nimage:\n  tag: 1.10\n")
    out = subprocess.run(
        [helm, "template", "orders", str(CHART), "--values", str(values)],
        text=True, capture_output=True,
    )  # fmt: skip
    assert out.returncode != 0
    assert 'image.tag: give it as a string (quoted, e.g. "1.10")' in out.stderr


def test_a_retry_replacing_a_pod_still_there_is_asked_only_of_kubernetes_that_knows_it(
    helm: str,
) -> None:
    """podReplacementPolicy is beta from 1.29: an older API server's schema refused it."""

    def job(kube: str) -> dict[str, Any]:
        sets = ["existingSecret=s", "reconcile.enabled=true", *RECONCILE, "reconcile.mode=schedule"]
        out = subprocess.run(
            [helm, "template", "orders", str(CHART), "--kube-version", kube,
             *(a for x in sets for a in ("--set", x))],
            check=True, text=True, capture_output=True,
        ).stdout  # fmt: skip
        (cron,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "CronJob"]
        return cron["spec"]["jobTemplate"]["spec"]  # type: ignore[no-any-return]

    assert job("1.29.0")["podReplacementPolicy"] == "Failed"
    assert "podReplacementPolicy" not in job("1.28.5")


def test_an_image_tag_given_as_a_number_names_the_image(helm: str) -> None:
    """Rendered "outbox-sidecar:%!s(int64=2)": the API server took it, and every pod (the
    migration hook's too) failed with InvalidImageName."""
    docs = reconcile_docs(helm, "image.tag=2", "reconcile.image.tag=2")  # --set: an int64
    for name, image in [("", "outbox-sidecar"), ("-reconcile", "outbox-reconcile")]:
        pod = docs[f"Deployment/orders-outbox-sidecar{name}"]["spec"]["template"]["spec"]
        assert [c["image"] for c in pod["containers"]] == [f"{image}:2"]


def reconcile_docs(helm: str, *sets: str) -> dict[str, dict[str, Any]]:
    docs = render(helm, "existingSecret=s", "reconcile.enabled=true", *RECONCILE, *sets)
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def job_settings(container: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """What the real job makes of the container's arguments (its DSN as the Secret gives it)."""
    from spark.job import build_parser, settings_from_args

    assert container["command"] == ["outboxctl", "reconcile"]
    (url,) = [e for e in container["env"] if e["name"] == "OUTBOX_DATABASE_URL"]
    assert url["valueFrom"]["secretKeyRef"] == {"name": "orders-reconciler", "key": "dsn"}
    assert not any("postgres" in a for a in container["args"])  # no DSN on the command line
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://reconciler@db/app")
    monkeypatch.delenv("OUTBOX_SPARK_JARS", raising=False)
    return settings_from_args(build_parser().parse_args(container["args"]))


def test_the_reconciliation_takes_a_new_checkpoint_when_its_topics_change(
    helm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job refuses a checkpoint made for other topics (Spark read a topic new to it from
    its start): an upgrade that changed them crash-looped it until someone moved the
    checkpoint. The same topics in another order, or spaced, are the same source."""

    def checkpoint(*sets: str) -> str | None:
        docs = reconcile_docs(helm, *sets)
        (container,) = docs["Deployment/orders-outbox-sidecar-reconcile"]["spec"]["template"][
            "spec"
        ]["containers"]
        return job_settings(container, monkeypatch).checkpoint

    one = checkpoint()
    two = checkpoint("reconcile.topics=orders.created\\,orders.paid")
    assert two == checkpoint("reconcile.topics=orders.paid\\, orders.created\\,")
    assert len({one, two, checkpoint("reconcile.markerTopic=other.markers")}) == 3
    assert one != checkpoint("reconcile.topics=", "reconcile.topicPattern=orders\\..*")


def test_the_reconciliation_runs_as_one_writer_of_its_checkpoint_with_args_the_job_takes(
    helm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = reconcile_docs(helm, "reconcile.kafkaOptions.security\\.protocol=SSL")
    deployment = docs["Deployment/orders-outbox-sidecar-reconcile"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # never two at once
    pod = deployment["spec"]["template"]
    relays = docs["Deployment/orders-outbox-sidecar"]["spec"]["selector"]["matchLabels"]
    assert not relays.items() <= pod["metadata"]["labels"].items()  # not one of the relays
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    settings = job_settings(container, monkeypatch)
    assert settings.topics == ("orders.created",)
    # on the claim, a directory of the source's own: the job refuses one of other topics
    assert (settings.checkpoint or "").startswith("/var/lib/outbox/checkpoint/by-source/")
    assert (settings.once, settings.trigger) == (False, timedelta(seconds=10))
    assert settings.kafka_options == {"security.protocol": "SSL"}
    assert settings.schema_name == "outbox"  # the sidecar's (migrations.schema)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    claim = docs["PersistentVolumeClaim/orders-outbox-sidecar-reconcile-checkpoint"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    checkpoint = volumes[mounts["/var/lib/outbox/checkpoint"]]["persistentVolumeClaim"]
    assert checkpoint["claimName"] == claim["metadata"]["name"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # Spark's local directory, writable; unbounded unless reconcile.scratchSizeLimit says
    assert volumes[mounts["/tmp"]]["emptyDir"] == {}
    # Spark 4 writes artifacts/ under the working directory: `/` failed every query's start
    assert mounts[container["workingDir"]] == "tmp"
    assert pod["spec"]["terminationGracePeriodSeconds"] > 60  # stop() joins its ticker 60 s
    # its probes and metrics, on the port the job is told to serve them on
    from spark.job import build_parser

    (port,) = container["ports"]
    assert build_parser().parse_args(container["args"]).http_port == port["containerPort"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port["name"]}
    assert not [
        k for k in docs if k.startswith(("Service/", "ServiceMonitor/")) and "reconcile" in k
    ]


def test_the_reconciliations_spark_ui_is_off_unless_asked(helm: str) -> None:
    """Spark's UI answered anyone reaching the pod, unauthenticated, and could kill the query's
    jobs (found by a review of the chart); the heap is passed as given."""

    def submit_args(*sets: str) -> str:
        pod = reconcile_docs(helm, *sets)["Deployment/orders-outbox-sidecar-reconcile"]
        (container,) = pod["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        return str(env["PYSPARK_SUBMIT_ARGS"])

    assert submit_args() == "--driver-memory 1g --conf spark.ui.enabled=false pyspark-shell"
    assert submit_args("reconcile.sparkUI=true", "reconcile.driverMemory=2g") == (
        "--driver-memory 2g pyspark-shell"
    )
    # as text (a quoted YAML value): "false" failed the render with a type error
    sets = ["existingSecret=s", "reconcile.enabled=true", *RECONCILE]
    out = subprocess.run(
        [helm, "template", "orders", str(CHART), *(a for x in sets for a in ("--set", x)),
         "--set-string", "reconcile.sparkUI=false"],
        text=True, capture_output=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "--conf spark.ui.enabled=false pyspark-shell" in out.stdout


def test_a_service_monitor_scrapes_the_running_reconciliation_apart_from_the_relays(
    helm: str,
) -> None:
    docs = reconcile_docs(helm, "serviceMonitor.enabled=true")
    pod = docs["Deployment/orders-outbox-sidecar-reconcile"]["spec"]["template"]
    service = docs["Service/orders-outbox-sidecar-reconcile"]
    monitor = docs["ServiceMonitor/orders-outbox-sidecar-reconcile"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == pod["spec"]["containers"][0]["ports"][0]["name"]
    assert monitor["spec"]["endpoints"][0]["port"] == port["name"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    # the relays' monitor and Service leave the job out, and the job's leave the relays out
    relays = docs["ServiceMonitor/orders-outbox-sidecar"]["spec"]["selector"]["matchLabels"]
    assert not relays.items() <= service["metadata"]["labels"].items()
    relay_service = docs["Service/orders-outbox-sidecar"]
    assert (
        not monitor["spec"]["selector"]["matchLabels"].items()
        <= relay_service["metadata"]["labels"].items()
    )


def test_a_scheduled_reconciliation_runs_once_at_a_time_on_a_claim_given(
    helm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = reconcile_docs(
        helm, "reconcile.mode=schedule", "reconcile.checkpoint.existingClaim=mine",
        "reconcile.topics=", "reconcile.topicPattern=orders[.].*",
    )  # fmt: skip
    assert not [k for k in docs if k.startswith("PersistentVolumeClaim/")]
    cron = docs["CronJob/orders-outbox-sidecar-reconcile"]["spec"]
    assert cron["concurrencyPolicy"] == "Forbid"
    pod = cron["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    settings = job_settings(container, monkeypatch)
    assert settings.once
    # a run of minutes serves no probes or metrics (the job refuses --http-port with --once)
    assert "--http-port" not in container["args"]
    assert not {"ports", "livenessProbe", "readinessProbe"} & container.keys()
    assert settings.topic_pattern == "orders[.].*"
    (checkpoint,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert checkpoint["persistentVolumeClaim"]["claimName"] == "mine"
    assert "activeDeadlineSeconds" not in cron["jobTemplate"]["spec"]  # unbounded by default


@pytest.mark.parametrize(("given", "volume"), [("8Gi", {"sizeLimit": "8Gi"}), ("", {})])
def test_the_reconciliations_scratch_space_is_bounded_as_given(
    helm: str, given: str, volume: dict[str, str]
) -> None:
    for mode in ("continuous", "schedule"):
        docs = reconcile_docs(helm, f"reconcile.mode={mode}", f"reconcile.scratchSizeLimit={given}")
        if mode == "schedule":
            cron = docs["CronJob/orders-outbox-sidecar-reconcile"]["spec"]
            spec = cron["jobTemplate"]["spec"]["template"]["spec"]
        else:
            spec = docs["Deployment/orders-outbox-sidecar-reconcile"]["spec"]["template"]["spec"]
        (scratch,) = [v for v in spec.get("volumes", []) if v["name"] == "tmp"]
        assert scratch["emptyDir"] == volume


def test_a_scheduled_run_can_be_bounded_so_that_one_hanging_holds_back_no_later_run(
    helm: str,
) -> None:
    docs = reconcile_docs(helm, "reconcile.mode=schedule", "reconcile.activeDeadlineSeconds=1800")
    job = docs["CronJob/orders-outbox-sidecar-reconcile"]["spec"]["jobTemplate"]["spec"]
    assert job["activeDeadlineSeconds"] == 1800


def test_kafka_secrets_reach_the_reconciliation_in_a_mounted_properties_file(
    helm: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A SASL login could not be given (kafkaOptions are on the command line): a Secret's
    properties file is mounted and named by --kafka-config, bootstrap servers from it too."""
    docs = reconcile_docs(
        helm, "reconcile.bootstrapServers=", "reconcile.kafkaConfigSecret.name=orders-kafka"
    )
    pod = docs["Deployment/orders-outbox-sidecar-reconcile"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "kafka-config"]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == "kafka-config"]
    assert volume["secret"]["secretName"] == "orders-kafka"
    assert "items" not in volume["secret"]  # its truststore beside the file
    args = container["args"]
    path = Path(args[args.index("--kafka-config") + 1])
    assert path.parent == Path(mount["mountPath"])
    assert path.name == "consumer.properties"
    assert "--bootstrap" not in args  # the file's bootstrap.servers
    (tmp_path / path.name).write_text(
        "bootstrap.servers=kafka-1:9093\nsecurity.protocol=SASL_SSL\nsasl.mechanism=PLAIN\n"
    )
    args[args.index("--kafka-config") + 1] = str(tmp_path / path.name)
    settings = job_settings(container, monkeypatch)
    assert settings.bootstrap_servers == "kafka-1:9093"
    assert settings.kafka_options["security.protocol"] == "SASL_SSL"
    with_both = reconcile_docs(helm, "reconcile.kafkaConfigSecret.name=orders-kafka")
    pod = with_both["Deployment/orders-outbox-sidecar-reconcile"]["spec"]["template"]["spec"]
    assert "kafka:9092" in pod["containers"][0]["args"]  # bootstrapServers over the file's


def test_the_reconcile_image_resolves_the_connector_of_the_pinned_pyspark() -> None:
    """The connector must match the Spark it runs in (constraints.txt pins PySpark)."""
    dockerfile = (ROOT / "helm" / "Dockerfile").read_text()
    pinned = re.search(r"^pyspark==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert pinned is not None
    assert f"-Dspark.version={pinned.group(1)}" in dockerfile
    assert "'kafka-outbox-sidecar[spark]'" in dockerfile
    assert "OUTBOX_SPARK_JARS=/opt/outbox/jars/*.jar" in dockerfile


def test_no_reconciliation_by_default(helm: str) -> None:
    docs = render(helm, "existingSecret=s")
    assert not [d for d in docs if "reconcile" in d["metadata"]["name"]]


def test_the_relays_spread_over_nodes_unless_told_otherwise(helm: str, tmp_path: Path) -> None:
    """Two relays on one node were both lost with it; a preference only, never a pod pending."""

    def constraints(values: str | None = None) -> Any:
        given = None
        if values is not None:
            given = tmp_path / "values.yaml"
            given.write_text(values)
        (deployment,) = [d for d in render(helm, "existingSecret=s", values=given)
                         if d["kind"] == "Deployment"]  # fmt: skip
        return deployment["spec"]["template"]["spec"].get("topologySpreadConstraints")

    relays = {"app.kubernetes.io/name": "outbox-sidecar", "app.kubernetes.io/instance": "orders"}
    assert constraints() == [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": relays},
        }
    ]
    own = (
        "topologySpreadConstraints:\n"
        "  - {maxSkew: 2, topologyKey: topology.kubernetes.io/zone,"
        " whenUnsatisfiable: DoNotSchedule, labelSelector: {matchLabels: {tier: relay}}}\n"
    )
    (zone,) = constraints(own)
    assert (zone["topologyKey"], zone["labelSelector"]) == (
        "topology.kubernetes.io/zone",
        {"matchLabels": {"tier": "relay"}},
    )
    assert constraints("topologySpreadConstraints: []\n") is None


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("reconcile.undeliveredDeadline=30s",),
        ("reconcile.undeliveredDeadline=60",),
        ("reconcile.deadline=1m30s", "reconcile.undeliveredDeadline=89.5"),
        ("reconcile.deadline=1m30s", "reconcile.undeliveredDeadline=90"),
        ("reconcile.deadline=5m", "reconcile.horizon=10m"),
        ("reconcile.deadline=5m", "reconcile.horizon=10m20s"),  # no room for the summary
        ("reconcile.deadline=5m", "reconcile.horizon=11m20s"),
        ("reconcile.deadline=1m", "reconcile.trigger=2m", "reconcile.horizon=5m"),
        # a scheduled run is not given the trigger: the job's own (10s) counts
        ("reconcile.deadline=1m", "reconcile.trigger=2m", "reconcile.horizon=5m",
         "reconcile.mode=schedule"),
        ("reconcile.horizon=29d",),
        ("reconcile.horizon=30d",),  # the findings' retention
        ("reconcile.horizon=30d", "reconcile.extraArgs={--findings-retention,90d}"),
        # --findings-retention leaves the other relations to the chart
        ("reconcile.undeliveredDeadline=30s", "reconcile.extraArgs={--findings-retention,90d}"),
        ("reconcile.deadline=.5", "reconcile.undeliveredDeadline=1e3", "reconcile.horizon=+90"),
        # a scheduled run is not passed the trigger at all
        ("reconcile.trigger=bogus", "reconcile.mode=schedule"),
    ],
)  # fmt: skip
def test_the_chart_refuses_the_reconciliations_durations_the_job_refuses(
    helm: str, monkeypatch: pytest.MonkeyPatch, sets: tuple[str, ...]
) -> None:
    """The job refused them at start, so a release Helm called deployed crash-looped."""
    from spark.job import ReconcileConfigError

    def container(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
        name = "orders-outbox-sidecar-reconcile"
        if "reconcile.mode=schedule" in sets:
            pod = docs[f"CronJob/{name}"]["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        else:
            pod = docs[f"Deployment/{name}"]["spec"]["template"]["spec"]
        (found,) = pod["containers"]
        return found  # type: ignore[no-any-return]

    refused = ""
    try:
        docs = reconcile_docs(helm, *sets)
    except subprocess.CalledProcessError as exc:
        refused = exc.stderr
    if not refused:
        job_settings(container(docs), monkeypatch)
        return
    assert re.search(r"reconcile\.(undeliveredDeadline|horizon) \(", refused), refused
    # the same values, left to the job by arguments giving the same deadline and horizon again
    given = dict(s.split("=", 1) for s in sets)
    again = f"{{--deadline={given.get('reconcile.deadline', '60s')},--horizon=" + (
        f"{given.get('reconcile.horizon', '15m')}}}"
    )
    kept = [s for s in sets if not s.startswith("reconcile.extraArgs=")]
    docs = reconcile_docs(helm, *kept, f"reconcile.extraArgs={again}")
    with pytest.raises(ReconcileConfigError):
        job_settings(container(docs), monkeypatch)


@pytest.mark.parametrize(
    ("sets", "said"),
    [
        (("reconcile.undeliveredDeadline=0",), "undeliveredDeadline: 0 must be positive"),
        (("reconcile.deadline=1m30x",), 'deadline: "1m30x" is not a duration'),
        (("reconcile.trigger=",), 'trigger: "" is not a duration'),
        (("reconcile.undeliveredDeadline=30s",), "undeliveredDeadline (30s) must not be shorter"),
        (("reconcile.trigger=50ms",), "trigger (50ms) must be at least 100ms"),
    ],
)
def test_a_refused_reconciliation_duration_is_named(
    helm: str, sets: tuple[str, ...], said: str
) -> None:
    with pytest.raises(subprocess.CalledProcessError) as refused:
        reconcile_docs(helm, *sets)
    assert f"reconcile.{said}" in refused.value.stderr


def test_an_extra_argument_naming_a_duration_leaves_its_relations_to_the_job(
    helm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """argparse takes an abbreviation (--hor) as the option, and the last one given wins."""
    docs = reconcile_docs(helm, "reconcile.deadline=5m", "reconcile.horizon=5m",
                          "reconcile.extraArgs={--hor=1h}")  # fmt: skip
    (found,) = docs["Deployment/orders-outbox-sidecar-reconcile"]["spec"]["template"]["spec"][
        "containers"
    ]
    assert job_settings(found, monkeypatch).horizon == timedelta(hours=1)


def test_a_duration_given_as_a_large_number_in_a_values_file_is_taken(
    helm: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """YAML's 1209600 reaches the template as a float64, printed 1.2096e+06: read as text, the
    chart refused what the job takes (14 days). A null undelivered deadline is unset."""
    values = tmp_path / "values.yaml"
    values.write_text("reconcile:\n  horizon: 1209600\n  undeliveredDeadline: null\n")
    docs = render(helm, "existingSecret=s", "reconcile.enabled=true", *RECONCILE, values=values)
    (deployment,) = [d for d in docs if d["metadata"]["name"] == "orders-outbox-sidecar-reconcile"
                     and d["kind"] == "Deployment"]  # fmt: skip
    (found,) = deployment["spec"]["template"]["spec"]["containers"]
    settings = job_settings(found, monkeypatch)
    assert settings.horizon == timedelta(days=14)
    assert settings.undelivered_deadline is None
