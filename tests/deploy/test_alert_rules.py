"""The chart's alert rules evaluated by Prometheus's own promtool (`promtool test rules`): each
fires on the series that mean its trouble, once its `for` has passed, with the labels an
Alertmanager routes by, and stays quiet on healthy series and on another namespace's.
test_helm_chart checks what the rules name (series, labels); these check what they compute."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.helm import render

RECONCILE = (
    "reconcile.enabled=true",
    "reconcile.existingSecret=orders-reconciler",
    "reconcile.bootstrapServers=kafka:9092",
    "reconcile.topics=orders.created",
)
NS = 'namespace="default"'  # helm template's namespace: the rules' matcher by default
OTHER = 'namespace="other"'  # another release's outbox, in the same Prometheus
WARN = {"severity": "warning"}
GROUP = 'pod="a", producer_group="%s"'


def _rules(helm: str, tmp_path: Path, *sets: str, annotations: bool = False) -> Path:
    """The rendered PrometheusRule's groups as a rule file. Without `annotations`, the tests
    compare the alerts' labels only (promtool compares annotations whenever an alert has them)."""
    docs = render(helm, "existingSecret=s", "prometheusRule.enabled=true", *sets)
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    groups = rule["spec"]["groups"]
    if not annotations:
        for group in groups:
            for r in group["rules"]:
                r.pop("annotations", None)
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return path


def _test_rules(promtool: str, rules: Path, *tests: dict[str, Any]) -> None:
    spec = {"rule_files": [rules.name], "evaluation_interval": "1m", "tests": list(tests)}
    path = rules.with_name("tests.yaml")
    path.write_text(yaml.safe_dump(spec))
    done = subprocess.run(
        [promtool, "test", "rules", path.name], cwd=path.parent, text=True, capture_output=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _at(minute: int, alert: str, *firing: dict[str, str]) -> dict[str, Any]:
    """At `minute`, these alerts of the name firing (none: it does not fire)."""
    return {
        "eval_time": f"{minute}m",
        "alertname": alert,
        "exp_alerts": [{"exp_labels": {**WARN, **labels}} for labels in firing],
    }


@pytest.mark.parametrize("mode", ["continuous", "schedule"])
def test_promtool_takes_the_rules_and_their_templates(
    helm: str, promtool: str, tmp_path: Path, mode: str
) -> None:
    rules = _rules(helm, tmp_path, *RECONCILE, f"reconcile.mode={mode}", annotations=True)
    done = subprocess.run([promtool, "check", "rules", str(rules)], text=True, capture_output=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_delivery_lag_fires_after_five_minutes_over_the_threshold_and_says_how_long(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """The oldest undelivered record grows a minute a minute: over 300 s from minute 6, firing
    from minute 11, its description the lag the worst relay of the namespace reports."""
    rules = _rules(helm, tmp_path, annotations=True)
    lagging = yaml.safe_load(rules.read_text())["groups"][0]["rules"][0]
    assert lagging["alert"] == "OutboxDeliveryLagging"
    _test_rules(
        promtool,
        rules,
        {
            "interval": "1m",
            "input_series": [
                {
                    "series": f'outbox_relay_oldest_undelivered_seconds{{{NS}, pod="a"}}',
                    "values": "0+60x20",
                },
                {
                    "series": f'outbox_relay_oldest_undelivered_seconds{{{NS}, pod="b"}}',
                    "values": "0+0x20",
                },
                {
                    "series": f'outbox_relay_oldest_undelivered_seconds{{{OTHER}, pod="c"}}',
                    "values": "9000+0x20",
                },
            ],
            "alert_rule_test": [
                _at(10, "OutboxDeliveryLagging"),
                {
                    **_at(12, "OutboxDeliveryLagging"),
                    "exp_alerts": [
                        {
                            "exp_labels": {**WARN, "namespace": "default"},
                            "exp_annotations": {
                                "summary": lagging["annotations"]["summary"],
                                "description": lagging["annotations"]["description"].replace(
                                    "{{ $value | humanizeDuration }}", "12m 0s"
                                ),
                            },
                        }
                    ],
                },
            ],
        },
    )


def test_an_endpoint_down_fires_after_ten_closed_free_minutes_per_producer_group(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """Open (1) or half open (2) for ten minutes fires; a single close in the ten does not."""
    _test_rules(
        promtool,
        _rules(helm, tmp_path),
        {
            "interval": "1m",
            "input_series": [
                {
                    "series": f"outbox_checker_circuit_state{{{NS}, {GROUP % 'pay'}}}",
                    "values": "0 0 1 2 1 2 1+0x20",
                },
                {
                    "series": f"outbox_checker_circuit_state{{{NS}, {GROUP % 'ship'}}}",
                    "values": "1+0x8 0 1+0x20",
                },
            ],
            "alert_rule_test": [
                _at(10, "OutboxCheckEndpointDown"),
                _at(
                    12,
                    "OutboxCheckEndpointDown",
                    {"namespace": "default", "producer_group": "pay"},
                ),
            ],
        },
    )


def test_shards_without_a_relay_fire_after_ten_minutes_and_so_does_no_relay_at_all(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """Relay b's pod goes at minute 5 (its series end): its two shards of four have no owner.
    Another namespace's relays all gone: `absent` fires for its own namespace only when its
    rules are that release's; here the release's namespace has relays."""
    rules = _rules(helm, tmp_path)
    relays = [
        {"series": f'outbox_relay_shards_owned{{{NS}, pod="a"}}', "values": "2+0x30"},
        {"series": f'outbox_relay_shards{{{NS}, pod="a"}}', "values": "4+0x30"},
        {"series": f'outbox_relay_shards_owned{{{NS}, pod="b"}}', "values": "2 2 2 2 2 stale"},
        {"series": f'outbox_relay_shards{{{NS}, pod="b"}}', "values": "4 4 4 4 4 stale"},
    ]
    _test_rules(
        promtool,
        rules,
        {
            "interval": "1m",
            "input_series": relays,
            "alert_rule_test": [
                _at(14, "OutboxShardsUnowned"),
                _at(16, "OutboxShardsUnowned", {"namespace": "default"}),
            ],
        },
        {
            "interval": "1m",
            "input_series": [  # crash-looping relays report nothing: only another outbox's
                {"series": f'outbox_relay_shards_owned{{{OTHER}, pod="c"}}', "values": "4+0x30"},
                {"series": f'outbox_relay_shards{{{OTHER}, pod="c"}}', "values": "4+0x30"},
            ],
            "alert_rule_test": [
                _at(9, "OutboxShardsUnowned"),
                _at(11, "OutboxShardsUnowned", {"namespace": "default"}),
            ],
        },
    )


def test_relay_errors_fire_over_the_rate_by_kind_and_dead_letter_refusals_at_any_rate(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """0.1 errors a second of one kind for ten minutes fires; 0.05 (the threshold) does not.
    The dead-letter topic's refusals, one a shard every 30 s, stay below that rate and have
    an alert of their own."""
    _test_rules(
        promtool,
        _rules(helm, tmp_path),
        {
            "interval": "1m",
            "input_series": [
                {
                    "series": f'outbox_relay_errors_total{{{NS}, pod="a", kind="kafka"}}',
                    "values": "0+6x30",
                },
                {
                    "series": f'outbox_relay_errors_total{{{NS}, pod="a", kind="database"}}',
                    "values": "0+3x30",
                },
                {
                    "series": f'outbox_relay_errors_total{{{NS}, pod="a", '
                    'kind="dead_letter_unwritable"}',
                    "values": "0 0 0 2+2x30",
                },
            ],
            "alert_rule_test": [
                _at(10, "OutboxRelayErrors"),
                _at(13, "OutboxRelayErrors", {"namespace": "default", "kind": "kafka"}),
                _at(7, "OutboxDeadLetterUnwritable"),
                _at(9, "OutboxDeadLetterUnwritable", {"namespace": "default"}),
            ],
        },
    )


def test_a_parking_fires_at_once_and_clears_fifteen_minutes_after_the_last(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """A parking at minute 6; the relay restarts at minute 10 (its counter starts again at 0)
    and parks one more at minute 12: that one counts too, and the alert clears once it is out
    of the 15 minutes' window."""
    _test_rules(
        promtool,
        _rules(helm, tmp_path),
        {
            "interval": "1m",
            "input_series": [
                {
                    "series": f'outbox_relay_records_parked_total{{{NS}, pod="a"}}',
                    "values": "3+0x5 4+0x3 0 0 1+0x30",
                },
            ],
            "alert_rule_test": [
                _at(5, "OutboxRecordsParked"),
                _at(7, "OutboxRecordsParked", {"namespace": "default"}),
                _at(25, "OutboxRecordsParked", {"namespace": "default"}),
                _at(27, "OutboxRecordsParked"),
            ],
        },
    )


def test_a_stalled_reconciliation_fires_once_its_last_judgement_is_old(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """Its last judgement at second 60, the threshold 900 s: over it from minute 17, firing
    from minute 22 (time() in promtool counts from 0)."""
    _test_rules(
        promtool,
        _rules(helm, tmp_path, *RECONCILE),
        {
            "interval": "1m",
            "input_series": [
                {
                    "series": f'outbox_reconcile_last_judgement_timestamp_seconds{{{NS}, pod="r"}}',
                    "values": "0 60+0x40",
                },
            ],
            "alert_rule_test": [
                _at(21, "OutboxReconcileStalled"),
                _at(23, "OutboxReconcileStalled", {"namespace": "default"}),
            ],
        },
    )


def _scheduled(helm: str, tmp_path: Path) -> tuple[Path, str]:
    docs = render(
        helm, "existingSecret=s", "prometheusRule.enabled=true", *RECONCILE,
        "reconcile.mode=schedule",
    )  # fmt: skip
    (cron,) = [d["metadata"]["name"] for d in docs if d["kind"] == "CronJob"]
    return _rules(helm, tmp_path, *RECONCILE, "reconcile.mode=schedule"), cron


def test_a_scheduled_run_that_failed_fires_until_a_later_run_succeeds(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """Run 100 (started at 6000 s) failed after the last success (3000 s): it fires; run 50,
    failed before that success, does not. A success at 7000 s ends it."""
    rules, cron = _scheduled(helm, tmp_path)
    job = f'{NS}, job_name="{cron}-%s"'
    _test_rules(
        promtool,
        rules,
        {
            "interval": "1m",
            "input_series": [
                {"series": f'kube_job_failed{{{job % 100}, condition="true"}}', "values": "1+0x20"},
                {
                    "series": f'kube_job_failed{{{job % 100}, condition="false"}}',
                    "values": "0+0x20",
                },
                {"series": f"kube_job_status_start_time{{{job % 100}}}", "values": "6000+0x20"},
                {"series": f'kube_job_failed{{{job % 50}, condition="true"}}', "values": "1+0x20"},
                {"series": f"kube_job_status_start_time{{{job % 50}}}", "values": "2000+0x20"},
                {
                    "series": f'kube_cronjob_status_last_successful_time{{{NS}, cronjob="{cron}"}}',
                    "values": "3000+0x9 7000+0x10",
                },
            ],
            "alert_rule_test": [
                _at(
                    2,
                    "OutboxReconcileRunFailed",
                    {"namespace": "default", "job_name": f"{cron}-100"},
                ),
                _at(12, "OutboxReconcileRunFailed"),
            ],
        },
    )


def test_no_scheduled_run_succeeding_fires_per_release_after_the_threshold(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """Made at 0 s and never succeeded: over 3600 s from minute 61, firing from minute 66, and
    said with the namespace and CronJob, so that two releases' alerts stay two."""
    rules, cron = _scheduled(helm, tmp_path)
    _test_rules(
        promtool,
        rules,
        {
            "interval": "1m",
            "input_series": [
                {"series": f'kube_cronjob_created{{{NS}, cronjob="{cron}"}}', "values": "0+0x80"},
                {
                    "series": f'kube_cronjob_created{{{OTHER}, cronjob="{cron}"}}',
                    "values": "0+0x80",
                },
            ],
            "alert_rule_test": [
                _at(65, "OutboxReconcileUnsucceeded"),
                _at(67, "OutboxReconcileUnsucceeded", {"namespace": "default", "cronjob": cron}),
            ],
        },
    )


# alert, its series in the release's namespace (scraped every minute) (each also given to another
# namespace, which must not fire), a time it does not fire yet, a time it fires, with labels
SIMPLE = [
    ("OutboxSidecarPartStopped", {'outbox_sidecar_part_stopped{%s, pod="a", part="checker"}':
     "1+0x20", 'outbox_sidecar_part_stopped{%s, pod="a", part="relay"}': "0+0x20"},
     4, 6, {"pod": "a", "part": "checker"}),
    ("OutboxXidHorizonHeld", {'outbox_relay_horizon_held_seconds{%s, pod="a"}': "700+0x20"},
     4, 6, {}),
    # a day of samples a minute apart: hourly ones are gone between samples (the lookback)
    ("OutboxParkedRecordsWaiting", {'outbox_relay_parked_records{%s, pod="a"}': "3+0x1600"},
     23 * 60, 25 * 60, {}),
    ("OutboxTransactionsDiscarded",
     {'outbox_checker_discards_total{%s, pod="a", producer_group="pay", limit="max_checks"}':
      "0 0 0 1+0x20"}, 2, 4, {"producer_group": "pay", "limit": "max_checks"}),
    ("OutboxPreparedTooOld",
     {'outbox_checker_oldest_prepared_age_seconds{%s, pod="a"}': "3700+60x20"}, 4, 6, {}),
    ("OutboxCheckerFailing",
     {'outbox_checker_rounds_total{%s, pod="a", result="error"}': "0+1x30",
      'outbox_checker_rounds_total{%s, pod="a", result="ok"}': "0+100x30"}, 9, 12, {}),
    ("OutboxRelayLeasesLost",
     {'outbox_relay_lease_changes_total{%s, pod="a", change="lost"}': "0 0 0 1+0x20",
      'outbox_relay_lease_changes_total{%s, pod="b", change="taken"}': "0+1x20"},
     2, 4, {"pod": "a"}),
    ("OutboxDeadLetterCopiesShrunk",
     {'outbox_relay_dead_letter_copies_total{%s, pod="a", form="bare"}': "0 0 0 1+0x20",
      'outbox_relay_dead_letter_copies_total{%s, pod="a", form="full"}': "0+5x20"},
     2, 4, {"form": "bare"}),
    ("OutboxReconcileFindings",
     {'outbox_reconcile_findings_total{%s, pod="r", kind="missing"}': "0 0 0 2+0x20",
      'outbox_reconcile_findings_total{%s, pod="r", kind="duplicate"}': "0+0x20"},
     2, 4, {"kind": "missing"}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("alert", "series", "quiet", "fires", "labels"),
    SIMPLE,
    ids=[case[0] for case in SIMPLE],
)
def test_each_other_alert_fires_on_its_trouble_in_its_namespace_only(
    helm: str,
    promtool: str,
    tmp_path: Path,
    alert: str,
    series: dict[str, str],
    quiet: int,
    fires: int,
    labels: dict[str, str],
) -> None:
    inputs = [
        {"series": name % where, "values": values}
        for name, values in series.items()
        for where in (NS, OTHER)
    ]
    _test_rules(
        promtool,
        _rules(helm, tmp_path, *RECONCILE),
        {
            "interval": "1m",
            "input_series": inputs,
            "alert_rule_test": [
                _at(quiet, alert),
                _at(fires, alert, {"namespace": "default", **labels}),
            ],
        },
    )


def test_every_alert_of_the_chart_is_evaluated_here(helm: str, tmp_path: Path) -> None:
    """A new alert gets a case of its own (above, or one of the tests before)."""
    tested = {case[0] for case in SIMPLE} | {
        "OutboxDeliveryLagging",
        "OutboxCheckEndpointDown",
        "OutboxShardsUnowned",
        "OutboxRelayErrors",
        "OutboxDeadLetterUnwritable",
        "OutboxRecordsParked",
        "OutboxReconcileStalled",
        "OutboxReconcileRunFailed",
        "OutboxReconcileUnsucceeded",
    }
    alerts = set()
    for mode in ("continuous", "schedule"):
        rules = _rules(helm, tmp_path, *RECONCILE, f"reconcile.mode={mode}")
        groups = yaml.safe_load(rules.read_text())["groups"]
        alerts |= {r["alert"] for g in groups for r in g["rules"]}
    assert alerts == tested
