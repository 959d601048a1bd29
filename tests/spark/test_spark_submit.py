"""The README's cluster command (packaging and spark-submit), run as written on local[2]."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_cluster_command() -> str:
    """The shell block of the README that packages the job and submits it to a cluster."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", readme, flags=re.DOTALL)
    (block,) = [b for b in blocks if "spark-submit" in b]
    return block


def test_the_readmes_spark_submit_command_reconciles(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    spark_jars: list[str],
) -> None:
    """Only the places differ (master, database, broker, topics, checkpoint): the packaging,
    the entry point and every argument are the README's, so that a change to either that
    breaks the documented command fails here."""
    orders, markers = topic_factory(), topic_factory()
    command = readme_cluster_command()
    for place, here in {
        "spark://master:7077": "'local[2]'",
        '"postgresql://reconciler@db:5432/app"': f'"{pg_dsn}"',
        "kafka:9092": kafka_bootstrap,
        r"'orders\..*'": "'" + re.escape(orders) + "'",
        "outbox.op-markers": markers,
        "hdfs:///checkpoints/outbox-reconcile": "dist/test-checkpoint --once",
    }.items():
        assert place in command, f"the README's command no longer has {place}"
        command = command.replace(place, here)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "OUTBOX_SPARK_JARS": ",".join(spark_jars),
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    try:
        done = subprocess.run(
            ["bash", "-ec", command],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        subprocess.run(["rm", "-rf", "dist/test-checkpoint"], cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "outbox reconcile (final)" in done.stdout, done.stdout
    assert "findings  0 (0 new)" in done.stdout, done.stdout
    # This venv has the project installed, so the driver above found it without the zip. A
    # cluster's driver has only the zip: everything the job imports of ours must be in it.
    zipped = ROOT / "dist" / "outbox_spark.zip"
    check = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in repr(f)]\n"
        "sys.path[:] = [p for p in sys.path if p not in ('', sys.argv[2])]\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import spark.job, relay, outbox\n"
        "print(spark.job.__file__, relay.__file__, outbox.__file__)\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", check, str(zipped), str(ROOT)],
        cwd="/",
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.split() == [
        f"{zipped}/spark/job.py",
        f"{zipped}/relay/__init__.py",
        f"{zipped}/outbox/__init__.py",
    ]


def test_a_conf_given_to_spark_submit_wins_over_the_jobs_own_defaults(tmp_path: Path) -> None:
    """The job sets a few session defaults of its own (spark.job.session_defaults). Under
    spark-submit it read the --conf given before it was connected to the JVM, so it found
    none and overrode them all."""
    from spark.job import CODEGEN_CACHE_ENTRIES, DATAFRAME_DEBUGGING

    script = tmp_path / "session.py"
    script.write_text(
        "from spark.config import ReconcileSettings\n"
        "from spark.job import build_session\n"
        "settings = ReconcileSettings(dsn='postgresql://u@db/app', bootstrap_servers='k:9092',\n"
        "                             topics=('orders',), checkpoint='/tmp/unused')\n"
        "session, owned = build_session(settings)\n"
        f"print('given', session.conf.get('{DATAFRAME_DEBUGGING[0]}'))\n"
        f"print('default', session.conf.get('{CODEGEN_CACHE_ENTRIES[0]}'))\n"
        "session.stop()\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "spark-submit"),
            "--master", "local[1]",
            "--conf", f"{DATAFRAME_DEBUGGING[0]}=true",
            str(script),
        ],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "given true" in done.stdout.splitlines(), done.stdout  # the --conf given stands
    assert f"default {CODEGEN_CACHE_ENTRIES[1]}" in done.stdout.splitlines(), done.stdout
