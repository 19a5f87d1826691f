"""A tiny order service that writes its order and the event announcing it in ONE
transaction, through mailroom's SQL API (docs/sql-api.md).

    pip install 'psycopg[binary]'
    psql "$ADMIN_URL" -f schema.sql && psql "$ADMIN_URL" -c \
      "GRANT SELECT, INSERT, UPDATE ON orders TO orders_service"
    python3 orders_service.py postgres://orders_service@127.0.0.1:5432/shop

If the transaction rolls back (an exception, a failed CHECK, a crash before COMMIT), the
order and its event are gone together; once it commits, mailroom publishes the event to
Kafka topic `orders`, keyed by the order id, after every earlier event of that order.
"""

import json
import sys

import psycopg
from psycopg.types.json import Jsonb

TOPIC = "orders"


def emit(cur, order_id, event_type, body, idempotency_key):
    """Enqueue one event in the caller's transaction; returns the outbox id."""
    cur.execute(
        "SELECT mailroom.enqueue(topic => %s, key => %s, payload => %s, headers => %s,"
        " type => %s, idempotency_key => %s)",
        (
            TOPIC,
            str(order_id),  # the key: every event of one order, in order
            json.dumps(body).encode(),
            Jsonb({"content-type": "application/json", "producer": "orders_service"}),
            event_type,
            idempotency_key,
        ),
    )
    return cur.fetchone()[0]


CREDIT_LIMIT_CENTS = 100_000


class OverCreditLimit(Exception):
    pass


def place_order(conn, customer, total_cents):
    with conn.transaction():
        with conn.cursor() as cur:
            cur.execute(
                "INSERT INTO orders (customer, total_cents) VALUES (%s, %s) RETURNING id",
                (customer, total_cents),
            )
            order_id = cur.fetchone()[0]
            event_id = emit(
                cur,
                order_id,
                "order.placed",
                {"order_id": order_id, "customer": customer, "total_cents": total_cents},
                f"order-{order_id}-placed",
            )
            # A rule checked after the event was written: raising rolls back the order
            # AND its event; nothing is ever published for it.
            if total_cents > CREDIT_LIMIT_CENTS:
                raise OverCreditLimit(f"{customer}: {total_cents} cents")
    return order_id, event_id


def cancel_order(conn, order_id):
    with conn.transaction():
        with conn.cursor() as cur:
            cur.execute(
                "UPDATE orders SET status = 'cancelled' WHERE id = %s AND status = 'placed'",
                (order_id,),
            )
            if cur.rowcount != 1:
                raise ValueError(f"order {order_id} cannot be cancelled")
            return emit(
                cur,
                order_id,
                "order.cancelled",
                {"order_id": order_id},
                f"order-{order_id}-cancelled",
            )


def main():
    url = sys.argv[1]
    out = {"placed": [], "cancelled": [], "refused": []}
    with psycopg.connect(url, autocommit=True) as conn:
        for customer, cents in [("ada", 1200), ("grace", 4500), ("edsger", 800)]:
            out["placed"].append(place_order(conn, customer, cents))
        first = out["placed"][0][0]
        out["cancelled"].append([first, cancel_order(conn, first)])
        # A failed business rule rolls the order back, and its event with it.
        try:
            place_order(conn, "mallory", 10_000_000)
        except OverCreditLimit:
            out["refused"].append("mallory")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
