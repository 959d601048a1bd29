"""The chart's alert rules evaluated by Prometheus's own promtool (`promtool test rules`): each
fires on the series that mean its trouble, once its `for` has passed, with the labels an
Alertmanager routes by, and stays quiet on healthy series and on another namespace's.
test_helm_chart checks what the rules name (series, labels); these check what they compute.

Series are written with `%s` where their namespace goes: each is given in the release's
namespace (helm template's, `default`) and, the same, in another, whose alerts must not fire
(the rules' default matcher is the release's namespace). Times are minutes from 0, a sample a
minute (promtool's expanding notation: 'a+bxc' is c+1 values; 'stale' ends a series)."""

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
SCHEDULED = (*RECONCILE, "reconcile.mode=schedule")
NS = 'namespace="default"'
OTHER = 'namespace="other"'
WARN = {"severity": "warning", "outbox_release": "orders"}  # the release: helm template's


def _render(helm: str, *sets: str) -> list[dict[str, Any]]:
    return render(helm, "existingSecret=s", "prometheusRule.enabled=true", *sets)


def _rules(docs: list[dict[str, Any]], tmp_path: Path, *, annotations: bool = False) -> Path:
    """The rendered PrometheusRule's groups as a rule file. Without `annotations`, the tests
    compare the alerts' labels only (promtool compares annotations whenever an alert has them)."""
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    groups = rule["spec"]["groups"]
    if not annotations:
        for group in groups:
            for r in group["rules"]:
                r.pop("annotations", None)
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return path


def _case(series: dict[str, str], *checks: dict[str, Any]) -> dict[str, Any]:
    """A promtool test group: `series` in both namespaces (see the module's docstring)."""
    inputs = [
        {"series": name % where if "%s" in name else name, "values": values}
        for name, values in series.items()
        for where in ((NS, OTHER) if "%s" in name else (None,))
    ]
    return {"interval": "1m", "input_series": inputs, "alert_rule_test": list(checks)}


def _test_rules(promtool: str, rules: Path, *cases: dict[str, Any]) -> None:
    spec = {"rule_files": [rules.name], "evaluation_interval": "1m", "tests": list(cases)}
    path = rules.with_name("tests.yaml")
    path.write_text(yaml.safe_dump(spec))
    done = subprocess.run(
        [promtool, "test", "rules", path.name], cwd=path.parent, text=True, capture_output=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _at(minute: int, alert: str, *firing: dict[str, str]) -> dict[str, Any]:
    """At `minute`, these alerts of the name firing, in the release's namespace (none: it does
    not fire)."""
    return {
        "eval_time": f"{minute}m",
        "alertname": alert,
        "exp_alerts": [
            {"exp_labels": {**WARN, "namespace": "default", **labels}} for labels in firing
        ],
    }


@pytest.mark.parametrize("mode", ["continuous", "schedule"])
def test_promtool_takes_the_rules_and_their_templates(
    helm: str, promtool: str, tmp_path: Path, mode: str
) -> None:
    docs = _render(helm, *RECONCILE, f"reconcile.mode={mode}")
    rules = _rules(docs, tmp_path, annotations=True)
    done = subprocess.run([promtool, "check", "rules", str(rules)], text=True, capture_output=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_delivery_lag_fires_after_five_minutes_over_the_threshold_and_says_how_long(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """The oldest undelivered record grows a minute a minute: over 300 s from minute 6, firing
    from minute 11, its description the lag the worst relay of the namespace reports."""
    rules = _rules(_render(helm), tmp_path, annotations=True)
    lagging = yaml.safe_load(rules.read_text())["groups"][0]["rules"][0]
    assert lagging["alert"] == "OutboxDeliveryLagging"
    firing = _at(12, "OutboxDeliveryLagging", {})
    firing["exp_alerts"][0]["exp_annotations"] = {
        "summary": lagging["annotations"]["summary"],
        "description": lagging["annotations"]["description"].replace(
            "{{ $value | humanizeDuration }}", "12m 0s"
        ),
    }
    _test_rules(
        promtool,
        rules,
        _case(
            {
                'outbox_relay_oldest_undelivered_seconds{%s, pod="a"}': "0+60x20",
                'outbox_relay_oldest_undelivered_seconds{%s, pod="b"}': "0+0x20",
                'outbox_relay_oldest_undelivered_seconds{namespace="third", pod="c"}': "9000x20",
            },
            _at(10, "OutboxDeliveryLagging"),
            firing,
        ),
    )


def test_an_endpoint_down_fires_after_ten_minutes_without_a_close_per_producer_group(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """Half open (1) or open (2) for ten minutes, checks held back or failing meanwhile, fires;
    one close in the ten does not, and neither do the first nine minutes of a circuit never
    closed (fewer than ten samples). A circuit with nothing to ask stays open after its endpoint
    recovered (it changes only with a request): that fired for hours (found by a review)."""
    circuit = 'outbox_checker_circuit_state{%s, pod="a", producer_group="%s"}'
    held = 'outbox_checker_checks_not_sent_total{%s, pod="a", producer_group="%s", why="%s"}'
    failed = 'outbox_checker_checks_total{%s, pod="a", producer_group="%s", outcome="%s"}'
    _test_rules(
        promtool,
        _rules(_render(helm), tmp_path),
        _case(
            {
                circuit % ("%s", "pay"): "0 0 1 2 1 2 1+0x20",
                held % ("%s", "pay", "circuit_open"): "0+1x30",
                circuit % ("%s", "ship"): "1+0x8 0 1+0x20",
                held % ("%s", "ship", "circuit_open"): "0+1x30",
                circuit % ("%s", "new"): "2+0x30",
                failed % ("%s", "new", "timeout"): "0+1x30",
                circuit % ("%s", "idle"): "2+0x30",  # open, nothing due: quiet
                held % ("%s", "idle", "deferred"): "0+1x30",
                failed % ("%s", "idle", "commit"): "0+1x30",
            },
            _at(8, "OutboxCheckEndpointDown"),
            _at(10, "OutboxCheckEndpointDown", {"producer_group": "new"}),
            _at(
                12,
                "OutboxCheckEndpointDown",
                {"producer_group": "new"},
                {"producer_group": "pay"},
            ),
        ),
    )


def test_shards_without_a_relay_fire_after_ten_minutes_and_so_does_no_relay_at_all(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """Relay b's pod goes at minute 5: its two shards of four have no owner, firing from
    minute 15. Then the release's relays report nothing at all (crash-looping) while another
    namespace's do: `absent` fires for the release's namespace after ten minutes, where the
    chart scrapes the relays (its ServiceMonitor); nothing scraping them, it fired for ever."""
    rules = _rules(_render(helm, "serviceMonitor.enabled=true"), tmp_path)
    _test_rules(
        promtool,
        rules,
        _case(
            {
                'outbox_relay_shards_owned{%s, pod="a"}': "2+0x30",
                'outbox_relay_shards{%s, pod="a"}': "4+0x30",
                # stale: gone as a pod's series go (else the 5 minutes' lookback kept them)
                'outbox_relay_shards_owned{%s, pod="b"}': "2 2 2 2 2 stale",
                'outbox_relay_shards{%s, pod="b"}': "4 4 4 4 4 stale",
            },
            _at(14, "OutboxShardsUnowned"),
            _at(16, "OutboxShardsUnowned", {}),
        ),
        _case(
            {
                f'outbox_relay_shards_owned{{{OTHER}, pod="c"}}': "4+0x30",
                f'outbox_relay_shards{{{OTHER}, pod="c"}}': "4+0x30",
            },
            _at(9, "OutboxShardsUnowned"),
            _at(11, "OutboxShardsUnowned", {}),
        ),
    )
    for sets in ((), ("mode=sidecar", "serviceMonitor.enabled=true")):  # not its relays'
        _test_rules(
            promtool,
            _rules(_render(helm, *sets, "podMonitor.selector.app=orders"), tmp_path),
            _case({}, _at(11, "OutboxShardsUnowned"), _at(30, "OutboxShardsUnowned")),
        )


@pytest.mark.parametrize(
    ("matchers", "routed_to"),
    [('job="orders"', "default"), ('namespace="orders", job="orders"', "orders")],
)
def test_nothing_reporting_fires_in_a_namespace_whatever_the_matchers(
    helm: str, promtool: str, tmp_path: Path, matchers: str, routed_to: str
) -> None:
    """`absent` takes its labels from the matchers' equalities only: with custom matchers
    that name no namespace, its alerts had none, and Alertmanager routes by it. They carry the
    release's namespace then, and the one the matchers name otherwise."""
    escaped = matchers.replace(",", "\\,")  # --set splits at commas
    sets = (*RECONCILE, "serviceMonitor.enabled=true", f"prometheusRule.matchers={escaped}")
    rules = _rules(_render(helm, *sets), tmp_path)
    # another job's series: the matchers leave them out, so nothing of this outbox reports
    others = {
        f'outbox_relay_shards_owned{{{OTHER}, job="payments"}}': "4+0x20",
        f'outbox_reconcile_last_judgement_timestamp_seconds{{{OTHER}, job="payments"}}': "60x20",
    }
    routed = {"namespace": routed_to, "job": "orders"}  # absent() keeps the equalities
    _test_rules(
        promtool,
        rules,
        _case(
            others,
            _at(11, "OutboxShardsUnowned", routed),
            _at(6, "OutboxReconcileStalled", routed),
        ),
    )


def test_two_outboxes_in_one_namespace_are_told_apart_by_matchers_and_release(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """Two releases in one namespace, each with matchers of its relays' job (the chart's
    ServiceMonitor's: the Service's name). The reconciliation is scraped under a job of its own:
    with the relays' matchers its series were never selected, and its stall fired for ever;
    `reconcileMatchers` selects them. The alerts carry the release (`outbox_release`): the two
    releases' alerts had the same labels, one alert to Alertmanager (found by a review)."""
    job = 'job="orders-outbox-sidecar"'
    sets = (
        *RECONCILE,
        "serviceMonitor.enabled=true",
        f"prometheusRule.matchers={job}",
        'prometheusRule.reconcileMatchers=job="orders-outbox-sidecar-reconcile"',
    )
    rules = _rules(_render(helm, *sets), tmp_path)
    payments = 'job="payments-outbox-sidecar"'
    _test_rules(
        promtool,
        rules,
        _case(
            {
                # this release's relays own half the shards; the other release's, all of theirs
                f'outbox_relay_shards_owned{{{NS}, {job}, pod="a"}}': "2+0x20",
                f'outbox_relay_shards{{{NS}, {job}, pod="a"}}': "4+0x20",
                f'outbox_relay_shards_owned{{{NS}, {payments}, pod="p"}}': "4+0x20",
                f'outbox_relay_shards{{{NS}, {payments}, pod="p"}}': "4+0x20",
                # the reconciliation judges every minute (the sample is the time of its last)
                f"outbox_reconcile_last_judgement_timestamp_seconds{{{NS}, "
                'job="orders-outbox-sidecar-reconcile"}': "0+60x20",
            },
            _at(11, "OutboxShardsUnowned", {}),  # the release's labels: see WARN
            _at(11, "OutboxReconcileStalled"),
        ),
    )


def test_parked_records_waiting_fire_through_a_handover_of_the_counting_relay(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """One relay counts the parked records and the others say 0; a deploy replaces them, and
    the max read 0 for a scrape: the day's wait started again, and with daily deploys the alert
    never fired (found by a review of the chart)."""
    _test_rules(
        promtool,
        _rules(_render(helm), tmp_path),
        _case(
            {  # a counts until its pod goes at 12 h; b counts from a minute later
                'outbox_relay_parked_records{%s, pod="a"}': "3+0x720 stale",
                'outbox_relay_parked_records{%s, pod="b"}': "_x721 0 3+0x900",
            },
            _at(23 * 60, "OutboxParkedRecordsWaiting"),
            _at(25 * 60, "OutboxParkedRecordsWaiting", {}),
        ),
    )


def test_relay_errors_fire_over_the_rate_by_kind_and_dead_letter_refusals_at_any_rate(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """0.1 errors a second of one kind (over 0.05 from minute 3) fires from minute 13; 0.05,
    the threshold itself, never does. The dead-letter topic's refusals, one a shard every
    30 s, stay below that rate and have an alert of their own."""
    errors = 'outbox_relay_errors_total{%s, pod="a", kind="%s"}'
    _test_rules(
        promtool,
        _rules(_render(helm), tmp_path),
        _case(
            {
                errors % ("%s", "kafka"): "0+6x30",
                errors % ("%s", "database"): "0+3x30",
                errors % ("%s", "dead_letter_unwritable"): "0 0 0 2+2x30",
            },
            _at(12, "OutboxRelayErrors"),
            _at(13, "OutboxRelayErrors", {"kind": "kafka"}),
            _at(25, "OutboxRelayErrors", {"kind": "kafka"}),
            _at(7, "OutboxDeadLetterUnwritable"),
            _at(9, "OutboxDeadLetterUnwritable", {}),
        ),
    )


def test_a_parking_fires_at_once_and_one_after_a_restart_counts_too(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """A parking at minute 6; the relay restarts at minute 10 (its counter starts again at 0)
    and parks one more at minute 12. At minute 20 only the reset and that parking are in the
    15 minutes (a plain delta would be -3); the alert clears once it is out of them."""
    _test_rules(
        promtool,
        _rules(_render(helm), tmp_path),
        _case(
            {'outbox_relay_records_parked_total{%s, pod="a"}': "3+0x5 4+0x3 0 0 1+0x30"},
            _at(5, "OutboxRecordsParked"),
            _at(7, "OutboxRecordsParked", {}),
            _at(20, "OutboxRecordsParked", {}),
            _at(25, "OutboxRecordsParked", {}),
            _at(27, "OutboxRecordsParked"),
        ),
    )


@pytest.mark.parametrize("scraped", [False, True])
def test_a_stalled_reconciliation_fires_once_its_last_judgement_is_old(
    helm: str, promtool: str, tmp_path: Path, scraped: bool
) -> None:
    """Its last judgement at second 60, the threshold 900 s: over it from minute 17, firing
    from minute 22 (time() counts from 0 here). Scraped (serviceMonitor), a job that reports
    nothing at all fires too."""
    sets = (*RECONCILE, "serviceMonitor.enabled=true") if scraped else RECONCILE
    rules = _rules(_render(helm, *sets), tmp_path)
    judged = {'outbox_reconcile_last_judgement_timestamp_seconds{%s, pod="r"}': "60+0x40"}
    silent = {f'outbox_reconcile_last_judgement_timestamp_seconds{{{OTHER}, pod="r"}}': "60x40"}
    _test_rules(
        promtool,
        rules,
        _case(
            judged,
            _at(21, "OutboxReconcileStalled"),
            _at(23, "OutboxReconcileStalled", {}),
        ),
        _case(
            silent,
            _at(4, "OutboxReconcileStalled"),
            _at(6, "OutboxReconcileStalled", *([{}] if scraped else [])),
        ),
    )


def test_a_scheduled_run_that_failed_fires_until_a_later_run_succeeds(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """Run 100 (started at 6000 s) failed after the last success (3000 s): it fires; run 50,
    failed before that success, does not. A success at 7000 s ends it. Before any success at
    all, a failed run fires."""
    docs = _render(helm, *SCHEDULED)
    (cron,) = [d["metadata"]["name"] for d in docs if d["kind"] == "CronJob"]
    job = f'%s, job_name="{cron}-%s"'
    runs = {
        f'kube_job_failed{{{job % ("%s", 100)}, condition="true"}}': "1+0x20",
        f'kube_job_failed{{{job % ("%s", 100)}, condition="false"}}': "0+0x20",
        f"kube_job_status_start_time{{{job % ('%s', 100)}}}": "6000+0x20",
    }
    _test_rules(
        promtool,
        _rules(docs, tmp_path),
        _case(
            {
                **runs,
                f'kube_job_failed{{{job % ("%s", 50)}, condition="true"}}': "1+0x20",
                f"kube_job_status_start_time{{{job % ('%s', 50)}}}": "2000+0x20",
                f'kube_cronjob_status_last_successful_time{{%s, cronjob="{cron}"}}': (
                    "3000+0x9 7000+0x10"
                ),
            },
            _at(2, "OutboxReconcileRunFailed", {"job_name": f"{cron}-100"}),
            _at(12, "OutboxReconcileRunFailed"),
        ),
        _case(runs, _at(2, "OutboxReconcileRunFailed", {"job_name": f"{cron}-100"})),
    )


def test_no_scheduled_run_succeeding_fires_per_release_after_the_threshold(
    helm: str, promtool: str, tmp_path: Path
) -> None:
    """Made at 0 s and never succeeded: over 3600 s from minute 61, firing from minute 66, said
    with the namespace and CronJob, so that two releases' alerts stay two. A success at 3000 s
    counts from there instead."""
    docs = _render(helm, *SCHEDULED)
    (cron,) = [d["metadata"]["name"] for d in docs if d["kind"] == "CronJob"]
    created = {f'kube_cronjob_created{{%s, cronjob="{cron}"}}': "0+0x80"}
    succeeded = {f'kube_cronjob_status_last_successful_time{{%s, cronjob="{cron}"}}': "3000x80"}
    _test_rules(
        promtool,
        _rules(docs, tmp_path),
        _case(
            created,
            _at(65, "OutboxReconcileUnsucceeded"),
            _at(67, "OutboxReconcileUnsucceeded", {"cronjob": cron}),
        ),
        _case({**created, **succeeded}, _at(67, "OutboxReconcileUnsucceeded")),
    )


# alert, its series (see the module's docstring), a time it does not fire yet, a time it fires,
# with what labels besides namespace and severity
SIMPLE = [
    ("OutboxSidecarPartStopped", {'outbox_sidecar_part_stopped{%s, pod="a", part="checker"}':
     "1+0x20", 'outbox_sidecar_part_stopped{%s, pod="a", part="relay"}': "0+0x20"},
     4, 6, {"pod": "a", "part": "checker"}),
    # at the threshold first: not over it (from minute 6, firing from minute 11)
    ("OutboxXidHorizonHeld", {'outbox_relay_horizon_held_seconds{%s, pod="a"}':
     "600+0x5 700+0x20"}, 10, 12, {}),
    # a day of samples a minute apart: hourly ones are gone between samples (the lookback)
    ("OutboxParkedRecordsWaiting", {'outbox_relay_parked_records{%s, pod="a"}': "3+0x1600"},
     23 * 60, 25 * 60, {}),
    ("OutboxTransactionsDiscarded",
     {'outbox_checker_discards_total{%s, pod="a", producer_group="pay", limit="max_checks"}':
      "0 0 0 1+0x20"}, 2, 4, {"producer_group": "pay", "limit": "max_checks"}),
    ("OutboxPreparedTooOld",
     {'outbox_checker_oldest_prepared_age_seconds{%s, pod="a"}': "3600+0x5 3700+60x20"},
     10, 12, {}),
    # rounds that succeed all along, failing from minute 13: firing from minute 23
    ("OutboxCheckerFailing",
     {'outbox_checker_rounds_total{%s, pod="a", result="error"}': "0+0x12 1+1x30",
      'outbox_checker_rounds_total{%s, pod="a", result="ok"}': "0+100x45"}, 21, 24, {}),
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
    ("alert", "series", "quiet", "fires", "labels"), SIMPLE, ids=[case[0] for case in SIMPLE]
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
    _test_rules(
        promtool,
        _rules(_render(helm, *RECONCILE), tmp_path),
        _case(series, _at(quiet, alert), _at(fires, alert, labels)),
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
    for sets in (RECONCILE, SCHEDULED):
        groups = yaml.safe_load(_rules(_render(helm, *sets), tmp_path).read_text())["groups"]
        alerts |= {r["alert"] for g in groups for r in g["rules"]}
    assert alerts == tested
