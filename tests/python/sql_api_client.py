"""The SQL API from Python (psycopg 3), inside business transactions.

Usage: sql_api_client.py APP_URL
       sql_api_client.py --crash-child APP_URL ORDER_ID KEY APP_NAME   (internal)

APP_URL connects as an application role holding the database's producer role, with SELECT and
INSERT on a table `orders (id bigint primary key, total integer)`. Prints one JSON line:
what was committed (per key, payloads in commit order), rolled back and crashed, and the
SQLSTATEs seen. tests/it/sql_api.rs drives it and checks Kafka against it.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psycopg

TOPIC = "py.sql.orders"


def enqueue(cur, key, payload, **kw):
    cur.execute(
        "SELECT mailroom.enqueue(topic => %s, key => %s, payload => %s, headers => %s,"
        " type => %s, idempotency_key => %s)",
        (
            TOPIC,
            key,
            payload,
            psycopg.types.json.Jsonb(kw.get("headers", {})),
            kw.get("type", "order.created"),
            kw.get("idempotency_key"),
        ),
    )
    return cur.fetchone()[0]


def place_order(conn, order_id, key, payloads, commit=True):
    """The order row and its events: one transaction."""
    ids = []
    with conn.cursor() as cur:
        cur.execute("INSERT INTO orders (id, total) VALUES (%s, 10)", (order_id,))
        for p in payloads:
            ids.append(enqueue(cur, key, p.encode(), headers={"order": str(order_id)}))
    if commit:
        conn.commit()
    else:
        conn.rollback()
    return ids


def crash_child(url, order_id, key, app_name):
    conn = psycopg.connect(url, application_name=app_name)
    with conn.cursor() as cur:
        cur.execute("INSERT INTO orders (id, total) VALUES (%s, 10)", (order_id,))
        event_id = enqueue(cur, key, b"py-crash")
    print(event_id, flush=True)
    time.sleep(120)  # killed long before this ends, its transaction still open


def crash(url, order_id, key):
    """A caller killed (SIGKILL) between its enqueue and its commit."""
    app_name = f"py-crash-{os.getpid()}"
    child = subprocess.Popen(
        [sys.executable, __file__, "--crash-child", url, str(order_id), key, app_name],
        stdout=subprocess.PIPE,
        text=True,
    )
    event_id = int(child.stdout.readline())  # the enqueue ran; the transaction is open
    with psycopg.connect(url, autocommit=True) as conn:
        state = conn.execute(
            "SELECT state FROM pg_stat_activity WHERE application_name = %s", (app_name,)
        ).fetchone()
        assert state == ("idle in transaction",), state
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        deadline = time.time() + 10
        while conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app_name,)
        ).fetchone()[0]:
            assert time.time() < deadline, "the server kept the dead backend"
            time.sleep(0.02)
    assert child.returncode == -signal.SIGKILL, child.returncode
    return event_id


def concurrent(url, n=6):
    """n transactions on one key, overlapping: they commit in one order."""
    barrier = threading.Barrier(n)
    order = []
    lock = threading.Lock()
    waited = []

    def run(i):
        with psycopg.connect(url) as conn:
            with conn.cursor() as cur:
                cur.execute("INSERT INTO orders (id, total) VALUES (%s, 1)", (200 + i,))
                barrier.wait()
                t0 = time.monotonic()
                event_id = enqueue(cur, "py-hot", f"h{i}".encode())
                w = time.monotonic() - t0
                with lock:
                    order.append((event_id, f"h{i}"))
                    waited.append(w)
                time.sleep(0.03)
            conn.commit()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [i for i, _ in order]
    assert ids == sorted(ids), f"ids not in commit order: {ids}"
    assert sum(1 for w in waited if w >= 0.02) >= n - 1, f"no overlap: {waited}"
    return [p for _, p in order]


def errors(conn):
    seen = {}
    cases = {
        "bad_topic": ("SELECT mailroom.enqueue('bad topic')", ()),
        "reserved_header": (
            "SELECT mailroom.enqueue('t', headers => %s)",
            (psycopg.types.json.Jsonb({"ce_id": "x"}),),
        ),
        "payload_too_large": (
            "SELECT mailroom.enqueue('t', payload => %s)",
            (b"x" * (1024 * 1024 + 1),),
        ),
    }
    for name, (sql, args) in cases.items():
        try:
            conn.execute(sql, args)
            raise AssertionError(f"{name} was accepted")
        except psycopg.Error as e:
            seen[name] = [e.sqlstate, e.diag.column_name]
            conn.rollback()
    # Same idempotency key, other content.
    conn.execute("SELECT mailroom.enqueue('t', idempotency_key => 'py-idem')")
    conn.commit()
    again = conn.execute("SELECT mailroom.enqueue('t', idempotency_key => 'py-idem')").fetchone()
    conn.commit()
    first = conn.execute("SELECT mailroom.enqueue('t', idempotency_key => 'py-idem')").fetchone()
    assert again == first
    try:
        conn.execute("SELECT mailroom.enqueue('t', 'other', idempotency_key => 'py-idem')")
        raise AssertionError("conflict accepted")
    except psycopg.Error as e:
        seen["conflict"] = [e.sqlstate, e.diag.column_name]
        conn.rollback()
    # The tables are private.
    try:
        conn.execute("SELECT count(*) FROM outbox_events")
        raise AssertionError("the producer role read the outbox")
    except psycopg.errors.InsufficientPrivilege as e:
        seen["select_outbox"] = [e.sqlstate, None]
        conn.rollback()
    return seen


def main():
    if sys.argv[1] == "--crash-child":
        crash_child(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
        return
    url = sys.argv[1]
    out = {"committed": {}, "rolled_back": [], "crashed": []}
    with psycopg.connect(url) as conn:
        out["committed"]["py-1"] = ["p1", "p2"]
        place_order(conn, 1, "py-1", ["p1", "p2"])
        out["rolled_back"] += place_order(conn, 2, "py-1", ["py-rolled-back"], commit=False)
        # A batch: one row per event, ids in array order.
        with conn.cursor() as cur:
            cur.execute("INSERT INTO orders (id, total) VALUES (3, 30)")
            cur.execute(
                "SELECT ord, id, duplicate FROM mailroom.enqueue_batch(topics => %s,"
                " keys => %s, payloads => %s)",
                ([TOPIC] * 3, ["py-2", "py-2", "py-1"], [b"q1", b"q2", b"p3"]),
            )
            rows = cur.fetchall()
        conn.commit()
        assert [r[0] for r in rows] == [1, 2, 3] and not any(r[2] for r in rows), rows
        assert [r[1] for r in rows] == sorted(r[1] for r in rows), rows
        out["committed"]["py-1"].append("p3")
        out["committed"]["py-2"] = ["q1", "q2"]
    out["crashed"].append(crash(url, 4, "py-1"))
    out["committed"]["py-hot"] = concurrent(url)
    with psycopg.connect(url) as conn:
        place_order(conn, 5, "py-1", ["p4"])
        out["committed"]["py-1"].append("p4")
        orders = [r[0] for r in conn.execute("SELECT id FROM orders ORDER BY id")]
        conn.commit()
        out["errors"] = errors(conn)
    out["orders"] = orders
    print(json.dumps(out))


if __name__ == "__main__":
    main()
