"""An `AsyncOutbox` call cancelled (asyncio.timeout, task.cancel()) commits nothing of itself,
whether the cancel reached the server before its statement ran or after."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq import TransactionStatus

import outbox
from outbox import AsyncOutbox, Record

pytestmark = pytest.mark.integration
GROUP = "cancel"


class SlowReplies:
    """A TCP proxy to Postgres that holds the server's replies back while `delay` is set: a
    slow network, or a busy server, after the statement has run."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.then_silent = False  # after the reply held back, none more: a network gone quiet
        # held back only once the client has sent this (a statement of the call's own, not
        # the Sync it makes first)
        self.once_sent: bytes | None = None
        self._sent = False

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, held: bool
    ) -> None:
        try:
            while data := await reader.read(65536):
                if not held and self.once_sent is not None and self.once_sent in data:
                    self._sent = True
                if held and self.delay and (self.once_sent is None or self._sent):
                    await asyncio.sleep(self.delay)
                    if self.then_silent:
                        self.delay = 3600.0
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    @asynccontextmanager
    async def serving(self, dsn: str) -> AsyncIterator[str]:
        """A DSN through the proxy."""
        given = conninfo_to_dict(dsn)
        host, port = str(given.get("host") or "127.0.0.1"), int(given.get("port") or 5432)
        pipes: set[asyncio.Task[None]] = set()

        async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
            server_r, server_w = await asyncio.open_connection(host, port)
            for task in (
                asyncio.create_task(self._pipe(client_r, server_w, False)),
                asyncio.create_task(self._pipe(server_r, client_w, True)),
            ):
                pipes.add(task)
                task.add_done_callback(pipes.discard)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        proxied = conninfo_to_dict(dsn) | {
            "host": "127.0.0.1",
            "port": server.sockets[0].getsockname()[1],
        }
        try:
            yield make_conninfo(**proxied)
        finally:
            server.close()
            for task in list(pipes):
                task.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)


async def count(dsn: str) -> int:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM outbox.outbox_record WHERE producer_group = %s", (GROUP,)
        )
        row = await cur.fetchone()
    return int(row[0]) if row else -1


def test_a_publish_timed_out_after_the_server_ran_it_commits_nothing(pg_dsn: str) -> None:
    """The cancel comes when the INSERT is done and its reply on the way: psycopg raised
    CancelledError with the transaction healthy and the records in it, and a caller who went
    on, or retried in the same transaction, committed them (twice on a retry)."""
    records = [Record("orders", {"n": i}, key=str(i)) for i in range(50)]
    box = AsyncOutbox(producer_group=GROUP)

    async def main() -> tuple[TransactionStatus, str]:
        proxy = SlowReplies()
        async with proxy.serving(pg_dsn) as dsn, await psycopg.AsyncConnection.connect(dsn) as conn:
            async with conn.transaction():
                await conn.execute("SELECT 1")  # the business rows
                proxy.delay = 1.0
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.3):
                        await box.publish_many(conn, records)
                proxy.delay = 0.0
                status = conn.info.transaction_status
                with pytest.raises(outbox.OutboxUsageError) as retry:
                    await box.publish_many(conn, records)  # a retry in the same transaction
            async with conn.transaction():  # the connection goes on
                await box.publish(conn, "orders", "after", key="a")
        return status, str(retry.value)

    status, retried = asyncio.run(main())
    assert status == TransactionStatus.INERROR
    assert "roll it back" in retried
    assert asyncio.run(count(pg_dsn)) == 1  # only the one published after


def test_a_publish_in_pipeline_mode_timed_out_after_the_server_ran_it_commits_nothing(
    pg_dsn: str,
) -> None:
    """The same in pipeline mode (checked by hand only before): the abort is queued like any
    other statement, and its error comes at the caller's next Sync, the block's commit, which
    then commits nothing. By then psycopg has read the cancelled statement's end: the status
    reads INTRANS, not the ACTIVE of statements still queued."""
    records = [Record("orders", {"n": i}, key=str(i)) for i in range(50)]
    box = AsyncOutbox(producer_group=GROUP)

    async def main() -> str:
        proxy = SlowReplies()
        ended = "committed"
        async with proxy.serving(pg_dsn) as dsn, await psycopg.AsyncConnection.connect(dsn) as conn:
            try:
                async with conn.pipeline(), conn.transaction():
                    await conn.execute("SELECT 1")  # the business rows
                    # the call's own Sync answered at once, its INSERT's reply held back
                    proxy.delay, proxy.once_sent = 1.0, b"INSERT INTO"
                    with pytest.raises(TimeoutError):
                        async with asyncio.timeout(0.3):
                            await box.publish_many(conn, records)
                    proxy.delay = 0.0
                    # the caller goes on: its block commits
            except psycopg.Error as exc:
                ended = str(exc)
            async with conn.transaction():  # the connection goes on
                await box.publish(conn, "orders", "after", key="a")
        return ended

    said = asyncio.run(main())
    assert "roll it back" in said
    assert asyncio.run(count(pg_dsn)) == 1  # only the one published after


def test_a_publish_cancelled_while_the_server_waits_commits_nothing(pg_dsn: str) -> None:
    """The other timing, for the same outcome: the server cancels the statement (waiting for
    a tx id's lock another transaction holds)."""
    box = AsyncOutbox(producer_group=GROUP)

    async def main() -> TransactionStatus:
        async with (
            await psycopg.AsyncConnection.connect(pg_dsn) as holder,
            await psycopg.AsyncConnection.connect(pg_dsn) as conn,
            await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as watcher,
        ):
            # not autocommit: the holder's transaction keeps the tx id's lock until rolled back
            await box.publish(holder, "orders", "first", key="k", tx_id="order-7")
            async with conn.transaction():
                task = asyncio.create_task(
                    box.publish(conn, "orders", "second", key="k", tx_id="order-7")
                )
                waiting = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s"
                pid = (conn.info.backend_pid,)
                while await (await watcher.execute(waiting, pid)).fetchone() != (True,):
                    await asyncio.sleep(0.02)  # until the server waits for the lock
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                status = conn.info.transaction_status
            await holder.rollback()
        return status

    assert asyncio.run(main()) == TransactionStatus.INERROR
    assert asyncio.run(count(pg_dsn)) == 0


def test_a_timeout_still_ends_the_call_when_the_server_goes_quiet_after_the_cancel(
    pg_dsn: str,
) -> None:
    """The abort after a cancel is one more round trip: with no answer to it the call waited
    for ever, and asyncio.timeout's TimeoutError never came out. It gives up as psycopg does
    for its own cancel (5 s), closing the connection, which ends the transaction."""
    box = AsyncOutbox(producer_group=GROUP)

    async def bounded(conn: psycopg.AsyncConnection[Any]) -> None:
        async with asyncio.timeout(0.3):
            await box.publish(conn, "orders", "v", key="k")

    async def main() -> tuple[float, bool, list[BaseException | None]]:
        proxy = SlowReplies()
        async with proxy.serving(pg_dsn) as dsn:
            conn = await psycopg.AsyncConnection.connect(dsn)
            await conn.execute("BEGIN")
            proxy.delay, proxy.then_silent = 1.0, True
            started = asyncio.get_running_loop().time()
            # the test's own bound (30 s): the call waited for ever before
            outcome = await asyncio.wait_for(
                asyncio.gather(bounded(conn), return_exceptions=True), 30
            )
            took = asyncio.get_running_loop().time() - started
            closed = conn.closed
            await conn.close()
        return took, closed, outcome

    took, closed, outcome = asyncio.run(main())
    assert [type(e) for e in outcome] == [TimeoutError]
    assert took < 15, took
    assert closed
    assert asyncio.run(count(pg_dsn)) == 0


async def server_ran(watch: psycopg.AsyncConnection[Any], pid: int, statement: str) -> None:
    """Until the backend `pid` has run a statement holding `statement` (its reply may still
    be on the way); 30 s at most."""
    last = "SELECT state, query FROM pg_stat_activity WHERE pid = %s"
    async with asyncio.timeout(30):
        while True:
            state, query = await (await watch.execute(last, (pid,))).fetchone() or ("", "")
            if state != "active" and statement in str(query):
                return
            await asyncio.sleep(0.02)


def test_a_second_cancel_during_the_abort_leaves_no_unretrieved_error(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    box = AsyncOutbox(producer_group=GROUP)

    async def main() -> None:
        proxy = SlowReplies()
        async with proxy.serving(pg_dsn) as dsn, await psycopg.AsyncConnection.connect(dsn) as conn:
            await conn.execute("BEGIN")
            proxy.delay = 0.5
            task = asyncio.create_task(box.publish(conn, "orders", "v", key="k"))
            async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as watch:
                pid = conn.info.backend_pid
                await server_ran(watch, pid, "INSERT INTO")
                task.cancel()  # lands while the INSERT's reply is held back
                await server_ran(watch, pid, "DO $$BEGIN RAISE")
            task.cancel()  # the abort's reply is held back: the task waits for it
            with pytest.raises(asyncio.CancelledError):
                await task
            proxy.delay = 0.0
            await conn.rollback()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(main())
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert asyncio.run(count(pg_dsn)) == 0


async def states(dsn: str) -> list[str]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT state::text FROM outbox.outbox_record WHERE producer_group = %s", (GROUP,)
        )
        return [row[0] for row in await cur.fetchall()]


@pytest.mark.parametrize("cancelled", ["at the commit", "in its local transaction", "while ending"])
def test_a_send_in_transaction_cancelled_says_which_records_it_leaves_prepared(
    pg_dsn: str, caplog: pytest.LogCaptureFixture, cancelled: str
) -> None:
    """CancelledError names nothing: the records a cancelled send_in_transaction left
    prepared, at its first commit, in the local transaction or while ending them, went
    unsaid until the checker asked about them (the code before logged nothing)."""
    box = AsyncOutbox(producer_group=GROUP)
    records = [Record("orders", {"n": i}, key="k") for i in range(2)]
    in_local = asyncio.Event()

    async def main() -> None:
        proxy = SlowReplies()
        async with (
            proxy.serving(pg_dsn) as dsn,
            await psycopg.AsyncConnection.connect(dsn) as conn,
            await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as watch,
            await psycopg.AsyncConnection.connect(pg_dsn) as holder,
        ):

            async def local(written: outbox.Written) -> str:
                in_local.set()
                if cancelled == "in its local transaction":
                    await asyncio.Event().wait()  # until cancelled
                if cancelled == "while ending":  # the end waits for the rows' lock
                    await holder.execute(
                        "SELECT id FROM outbox.outbox_record WHERE id = ANY(%s) FOR UPDATE",
                        (list(written.ids),),
                    )
                return "COMMIT"

            pid = conn.info.backend_pid
            if cancelled == "at the commit":
                proxy.delay = 0.3  # each reply: the COMMIT's is held back when the cancel comes
            task = asyncio.create_task(box.send_in_transaction(conn, records, local))
            async with asyncio.timeout(30):
                if cancelled == "at the commit":
                    activity = "SELECT state, query FROM pg_stat_activity WHERE pid = %s"
                    while await (await watch.execute(activity, (pid,))).fetchone() != (
                        "idle",
                        "COMMIT",
                    ):
                        await asyncio.sleep(0.02)
                elif cancelled == "in its local transaction":
                    await in_local.wait()
                else:
                    waiting = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s"
                    while await (await watch.execute(waiting, (pid,))).fetchone() != (True,):
                        await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await holder.rollback()

    with caplog.at_level(logging.WARNING, logger="outbox"):
        asyncio.run(main())
    (said,) = [r.getMessage() for r in caplog.records if "was cancelled" in r.getMessage()]
    assert f"was cancelled {cancelled}" in said
    assert asyncio.run(states(pg_dsn)) == ["prepared", "prepared"]
    ids = [int(i) for i in said.split("record ids ")[1].split(")")[0].split(", ")]
    assert len(ids) == 2
