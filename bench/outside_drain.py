"""Drain measured from outside (issue 27): the release binary with default settings, a
backlog stored first with the relays off (FILL=grpc: EnqueueBatch of 1,000; FILL=sql: the
SQL API's mailroom.enqueue_batch), then the service restarted with defaults; an independent
kafka-python consumer reads the topic back and reports the records' count, the span of their
CreateTime (set when mailroom handed each record to the producer) and the gaps between them.

usage: python3 bench/outside_drain.py BROKERS EVENTS KEYS TAG
  env: FILL=grpc|sql (grpc), READ_AFTER=seconds to wait before reading (0: read while it
       drains; the reader then competes for the CPU), SCRAPE=1 (save /metrics), DUMP=file (the sorted CreateTimes), MAILROOM_BIN,
       PG (postgresql://postgres@127.0.0.1:5432), LOGS (/tmp).
       With READ_AFTER, also the CPU seconds PostgreSQL and mailroom spent over the run;
       SAMPLE_CPU=1: the machine's busy share between the first and last CreateTime
Needs: cargo build --release --bin mailroom; pip install -r scripts/requirements-test.txt;
PostgreSQL and a broker (tansu: see docs/benchmarks.md). Exits non-zero when a record is missing.
"""
import os, sys, time, subprocess, uuid
import psycopg
from kafka import KafkaConsumer, TopicPartition
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BIN = os.environ.get("MAILROOM_BIN", os.path.join(ROOT, "target/release/mailroom"))
BROKERS, N, KEYS, TAG = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
LOGS = os.environ.get("LOGS", "/tmp")
PG = os.environ.get("PG", "postgresql://postgres@127.0.0.1:5432")
db = f"probe_{uuid.uuid4().hex[:8]}"
with psycopg.connect(PG + "/postgres", autocommit=True) as c:
    c.execute(f"CREATE DATABASE {db}")
url = PG.replace("postgresql://", "postgres://") + "/" + db
topic = f"probe_{TAG}_{uuid.uuid4().hex[:6]}"
env = dict(os.environ, MAILROOM_DATABASE_URL=url, MAILROOM_KAFKA_BROKERS=BROKERS, MAILROOM_LISTEN="127.0.0.1:50071")
def start(extra, log):
    return subprocess.Popen([BIN], env=dict(env, **extra), stdout=open(log, "w"), stderr=subprocess.STDOUT)
p = start({"MAILROOM_RELAYS": "0"}, f"{LOGS}/{TAG}-fill.log")
for _ in range(100):
    try:
        with psycopg.connect(url) as c:
            c.execute("SELECT 1 FROM outbox_events LIMIT 1"); break
    except Exception:
        time.sleep(0.2)
time.sleep(1)
if os.environ.get("FILL", "grpc") == "sql":
  with psycopg.connect(url, autocommit=True) as c:
    for lo in range(0, N, 1000):
        n = min(1000, N - lo)
        c.execute("SELECT count(*) FROM mailroom.enqueue_batch(%s, %s, %s)",
                  ([topic] * n, [f"key-{(lo + i) % KEYS}" for i in range(n)], [b"x" * 256] * n))
else:
    import importlib, grpc
    sys.path.insert(0, os.path.join(ROOT, "tests/python"))
    import outbox_client
    outbox_client.generate(os.path.join(ROOT, "proto"))
    pb = importlib.import_module("mailroom.v1.outbox_pb2")
    rpc = importlib.import_module("mailroom.v1.outbox_pb2_grpc")
    stub = rpc.OutboxServiceStub(grpc.insecure_channel("127.0.0.1:50071"))
    for lo in range(0, N, 1000):
        n = min(1000, N - lo)
        stub.EnqueueBatch(pb.EnqueueBatchRequest(events=[pb.Event(topic=topic, key=f"key-{(lo + i) % KEYS}", payload=b"x" * 256, type="bench.event") for i in range(n)]))
p.terminate(); p.wait()
if os.environ.get("FILL_ONLY"):
    print(db, topic); sys.exit(0)
t0 = time.time()
def stat(pid):
    """The fields of /proc/PID/stat after the command name (utime is [11])."""
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
def pg_cpu():
    """PostgreSQL's CPU seconds so far: its live processes' own and, through the
    postmaster's cutime/cstime, those of the backends it has reaped."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if not open(f"/proc/{pid}/comm").read().startswith("postgres"):
                continue
            f = stat(pid)
            total += int(f[11]) + int(f[12])
            if not open(f"/proc/{f[1]}/comm").read().startswith("postgres"):
                total += int(f[13]) + int(f[14])
        except OSError:
            pass
    return total / os.sysconf("SC_CLK_TCK")
def proc_cpu(pid):
    f = stat(pid)
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
# The machine's busy share over the drain itself (SAMPLE_CPU=1): /proc/stat every 20 ms
# from the service's start, later cut to the span of the records' CreateTimes.
samples = []
if os.environ.get("SAMPLE_CPU"):
    import threading
    def sample():
        while not stop_sampling.is_set():
            f = open("/proc/stat").readline().split()[1:]
            ticks = list(map(int, f))
            samples.append((time.time() * 1000, sum(ticks) - ticks[3] - ticks[4], sum(ticks)))
            time.sleep(0.02)
    stop_sampling = threading.Event()
    threading.Thread(target=sample, daemon=True).start()
pg0 = pg_cpu()
p = start({"MAILROOM_METRICS_LISTEN": "127.0.0.1:9391"} if os.environ.get("SCRAPE") else {}, f"{LOGS}/{TAG}-run.log")
cpu_note = ""
if os.environ.get("READ_AFTER"):
    time.sleep(float(os.environ["READ_AFTER"]))
    # Read before the reader starts: the drain is over by then, and the reader's fetches
    # cost neither process anything.
    cpu_note = f", CPU over the run: PostgreSQL {pg_cpu() - pg0:.2f} s, mailroom {proc_cpu(p.pid):.2f} s"
cons = KafkaConsumer(bootstrap_servers=BROKERS, enable_auto_commit=False, fetch_max_wait_ms=5)
parts = None
while not parts:
    parts = cons.partitions_for_topic(topic); time.sleep(0.05) if not parts else None
tps = [TopicPartition(topic, x) for x in parts]
cons.assign(tps); cons.seek_to_beginning(*tps)
ts = []
deadline = time.time() + 300
while len(ts) < N and time.time() < deadline:
    for tp, recs in cons.poll(timeout_ms=200, max_records=10000).items():
        ts.extend(r.timestamp for r in recs)
if os.environ.get("SCRAPE"):
    import urllib.request
    m = urllib.request.urlopen("http://127.0.0.1:9391/metrics").read().decode()
    open(f"{LOGS}/{TAG}-metrics.txt", "w").write(m)
p.terminate(); p.wait()
ts.sort()
if samples and ts:
    stop_sampling.set()
    inside = [x for x in samples if ts[0] <= x[0] <= ts[-1]]
    if len(inside) >= 2:
        busy = (inside[-1][1] - inside[0][1]) / max(inside[-1][2] - inside[0][2], 1)
        cpu_note += f", machine {busy * 100:.0f} % busy over the drain ({len(inside)} samples)"
if os.environ.get("DUMP"):
    open(os.environ["DUMP"], "w").write("\n".join(map(str, ts)))
if not ts:
    sys.exit(f"{TAG}: no record read back")
gaps = sorted(((ts[i+1]-ts[i]), i) for i in range(len(ts)-1))[::-1]
span = max(ts[-1] - ts[0], 1)
# The pauses (gaps of 3 ms or more: between runs and cycles, not inside a batch): how many
# and their median, steadier than the longest gap on a noisy machine.
pauses = sorted(g for g, _ in gaps if g >= 3)
pause_median = pauses[len(pauses) // 2] if pauses else 0
print(f"{TAG}: {len(ts)}/{N} records, span {span} ms = {len(ts)*1000/span:.0f}/s, top gaps (ms@index): {gaps[:6]}, gaps>20ms: {sum(1 for g,_ in gaps if g>20)}, pauses>=3ms: {len(pauses)} median {pause_median} ms{cpu_note}")
with psycopg.connect(PG + "/postgres", autocommit=True) as c:
    c.execute(f"DROP DATABASE {db} WITH (FORCE)")
if len(ts) < N:
    sys.exit(f"{TAG}: {N - len(ts)} records missing")
