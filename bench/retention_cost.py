"""What retention costs per event (issue 27, item 4): the release binary with default
settings stores EVENTS events over KEYS keys (EnqueueBatch of 1,000) and publishes them to
the local sink (/dev/null); their publication is then dated two hours back, and the binary
runs again with MAILROOM_RETENTION_COMPLETED_HOURS=1 and a 1 s retention interval (relays
on, nothing to publish). Reports how long retention took to delete every event and the
CPU time PostgreSQL's processes spent meanwhile (from /proc: the database server is on
this machine; read while the binary's connections are open, since /proc forgets exited
backends), per event deleted. At 10,000 events/s sustained, retention deletes
10,000 events/s too: the CPU per event times 10,000 is the share of a core it takes.

usage: python3 bench/retention_cost.py EVENTS KEYS
  env: MAILROOM_BIN (target/release/mailroom), PG (postgresql://postgres@127.0.0.1:5432),
       LOGS (/tmp), FILL_ONLY=1 (stop before retention and print the database's name)
Needs: cargo build --release --bin mailroom; pip install -r scripts/requirements-test.txt.
Exits non-zero when retention leaves an event behind.
"""
import os, sys, time, subprocess, uuid, importlib
import psycopg

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BIN = os.environ.get("MAILROOM_BIN", os.path.join(ROOT, "target/release/mailroom"))
N, KEYS = int(sys.argv[1]), int(sys.argv[2])
LOGS = os.environ.get("LOGS", "/tmp")
PG = os.environ.get("PG", "postgresql://postgres@127.0.0.1:5432")
TICK = os.sysconf("SC_CLK_TCK")

db = f"retention_{uuid.uuid4().hex[:8]}"
with psycopg.connect(PG + "/postgres", autocommit=True) as c:
    c.execute(f"CREATE DATABASE {db}")
url = PG.replace("postgresql://", "postgres://") + "/" + db
env = dict(os.environ, MAILROOM_DATABASE_URL=url, MAILROOM_LISTEN="127.0.0.1:50072",
           MAILROOM_LOCAL_SINK="/dev/null")
env.pop("MAILROOM_KAFKA_BROKERS", None)


def start(extra, log):
    return subprocess.Popen([BIN], env=dict(env, **extra), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)


def scalar(sql):
    with psycopg.connect(url) as c:
        return c.execute(sql).fetchone()[0]


def postgres_cpu():
    """CPU seconds (user + system) of every postgres process so far."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/comm") as f:
                if not f.read().startswith("postgres"):
                    continue
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICK


# 1. Store and publish the events (defaults; the local sink writes to /dev/null).
fill_cpu0 = postgres_cpu()
p = start({}, f"{LOGS}/retention-fill.log")
for _ in range(100):
    try:
        scalar("SELECT 1 FROM outbox_events LIMIT 1")
        break
    except Exception:
        time.sleep(0.2)
import grpc
sys.path.insert(0, os.path.join(ROOT, "tests/python"))
import outbox_client
outbox_client.generate(os.path.join(ROOT, "proto"))
pb = importlib.import_module("mailroom.v1.outbox_pb2")
rpc = importlib.import_module("mailroom.v1.outbox_pb2_grpc")
stub = rpc.OutboxServiceStub(grpc.insecure_channel("127.0.0.1:50072"))
for lo in range(0, N, 1000):
    n = min(1000, N - lo)
    stub.EnqueueBatch(pb.EnqueueBatchRequest(events=[
        pb.Event(topic="retention.bench", key=f"key-{(lo + i) % KEYS}", payload=b"x" * 256,
                 type="bench.event") for i in range(n)]))
while scalar("SELECT count(*) FROM outbox_events_view WHERE status <> 'completed'") > 0:
    time.sleep(0.5)
# Read before the binary stops: /proc forgets the CPU of backends that have exited.
fill_cpu = postgres_cpu() - fill_cpu0
p.terminate(); p.wait()

# 2. Date the publications two hours back, then let the database settle.
with psycopg.connect(url, autocommit=True) as c:
    c.execute("UPDATE outbox_publishes SET at = at - interval '2 hours'")
    c.execute("UPDATE outbox_events SET published_at = published_at - interval '2 hours' "
              "WHERE status = 'completed'")
    c.execute("VACUUM ANALYZE")
time.sleep(2)
stored = scalar("SELECT count(*) FROM outbox_events")
if os.environ.get("FILL_ONLY"):
    print(db)
    sys.exit(0)

# 3. Retention with its default batch, a round every second.
cpu0, t0 = postgres_cpu(), time.time()
p = start({"MAILROOM_RETENTION_COMPLETED_HOURS": "1", "MAILROOM_RETENTION_INTERVAL_MS": "1000"},
          f"{LOGS}/retention-run.log")
left = stored
while left > 0 and time.time() - t0 < 600:
    time.sleep(0.25)
    left = scalar("SELECT count(*) FROM outbox_events")
took, cpu = time.time() - t0, postgres_cpu() - cpu0
p.terminate(); p.wait()
print(f"retention: {stored} events over {KEYS} keys deleted in {took:.1f} s "
      f"({stored / took:,.0f}/s wall, first round after up to 1 s); PostgreSQL CPU "
      f"{cpu:.2f} s = {cpu / stored * 1e6:.1f} µs per event; at 10,000 events/s: "
      f"{cpu / stored * 1e4:.2f} of a core; storing and publishing them took "
      f"{fill_cpu / stored * 1e6:.1f} µs per event (retention adds "
      f"{cpu / fill_cpu * 100:.0f} %)")
if left:
    sys.exit(f"{left} events left after retention")
