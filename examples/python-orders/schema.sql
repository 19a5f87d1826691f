-- The order service's own table, in the database mailroom migrates (it owns the
-- `mailroom` schema there). The service's login role holds the database's producer role:
--   CREATE ROLE orders_service LOGIN PASSWORD '…' IN ROLE mailroom_producer_shop;
CREATE TABLE IF NOT EXISTS orders (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer   TEXT        NOT NULL,
    total_cents BIGINT     NOT NULL CHECK (total_cents >= 0),
    status     TEXT        NOT NULL DEFAULT 'placed',
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
