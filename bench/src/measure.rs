//! Measuring: CPU from `/proc`, peak RSS, latency percentiles, the load driver, and
//! the result table with its targets.

use super::*;

/// Clock ticks per second of `/proc/*/stat` (USER_HZ; 100 on Linux x86-64 and arm64).
pub(crate) const TICKS: f64 = 100.0;

pub(crate) fn status_kb(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Resets the peak-RSS mark to the current RSS; false where the kernel refuses.
pub(crate) fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

pub(crate) fn mb(kb: Option<u64>) -> f64 {
    kb.unwrap_or(0) as f64 / 1024.0
}

/// utime + stime of a process, in ticks.
pub(crate) fn proc_ticks(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

pub(crate) fn postgres_ticks() -> HashMap<u32, u64> {
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.trim() == "postgres"
            && let Some(t) = proc_ticks(pid)
        {
            out.insert(pid, t);
        }
    }
    out
}

/// (busy, total) ticks of the whole machine.
pub(crate) fn machine_ticks() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = s
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// CPU counters at one instant.
pub(crate) struct CpuMark {
    pub(crate) at: Instant,
    pub(crate) me: u64,
    pub(crate) pg: HashMap<u32, u64>,
    pub(crate) broker: u64,
    pub(crate) machine: (u64, u64),
}

/// CPU used between two marks, in % of one core (machine: % of all cores).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CpuUse {
    pub(crate) me: f64,
    pub(crate) pg: f64,
    pub(crate) broker: f64,
    pub(crate) machine: f64,
}

impl CpuMark {
    pub(crate) fn take(broker_pid: Option<u32>) -> CpuMark {
        CpuMark {
            at: Instant::now(),
            me: proc_ticks(std::process::id()).unwrap_or(0),
            pg: postgres_ticks(),
            broker: broker_pid.and_then(proc_ticks).unwrap_or(0),
            machine: machine_ticks(),
        }
    }

    pub(crate) fn since(&self, broker_pid: Option<u32>) -> CpuUse {
        let now = CpuMark::take(broker_pid);
        let secs = now.at.duration_since(self.at).as_secs_f64().max(1e-3);
        let pct = |ticks: u64| ticks as f64 / TICKS / secs * 100.0;
        let pg: u64 = now
            .pg
            .iter()
            .map(|(pid, t)| t.saturating_sub(self.pg.get(pid).copied().unwrap_or(0)))
            .sum();
        let busy = now.machine.0.saturating_sub(self.machine.0);
        let total = now.machine.1.saturating_sub(self.machine.1).max(1);
        CpuUse {
            me: pct(now.me.saturating_sub(self.me)),
            pg: pct(pg),
            broker: pct(now.broker.saturating_sub(self.broker)),
            machine: busy as f64 / total as f64 * 100.0,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Latency {
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) p999: f64,
    pub(crate) max: f64,
}

/// Percentiles (ms) of latencies given in microseconds.
pub(crate) fn latency(mut us: Vec<u64>) -> Option<Latency> {
    if us.is_empty() {
        return None;
    }
    us.sort_unstable();
    let n = us.len();
    let at = |p: f64| us[((p * n as f64).ceil() as usize).clamp(1, n) - 1] as f64 / 1000.0;
    Some(Latency {
        p50: at(0.50),
        p99: at(0.99),
        p999: at(0.999),
        max: us[n - 1] as f64 / 1000.0,
    })
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Row {
    pub(crate) name: String,
    pub(crate) events: u64,
    pub(crate) secs: f64,
    pub(crate) latency: Option<Latency>,
    pub(crate) peak_rss_mb: f64,
    pub(crate) cpu: CpuUse,
    /// The baseline this row is compared with (a row name).
    pub(crate) baseline: Option<&'static str>,
    pub(crate) notes: Vec<String>,
    /// WAL bytes the step wrote (the `wal` scenario's rows).
    pub(crate) wal_bytes: Option<i64>,
}

impl Row {
    pub(crate) fn rate(&self) -> f64 {
        if self.secs > 0.0 {
            self.events as f64 / self.secs
        } else {
            0.0
        }
    }
}

pub(crate) fn fmt_ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

pub(crate) fn table(rows: &[Row]) -> String {
    let mut s = String::from(
        "| scenario | events | s | events/s | p50 ms | p99 ms | p99.9 ms | peak RSS MB | vs baseline | CPU % bench / pg / broker / machine | notes |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---|---|---|\n",
    );
    for r in rows {
        let (p50, p99, p999) = match &r.latency {
            Some(l) => (fmt_ms(l.p50), fmt_ms(l.p99), fmt_ms(l.p999)),
            None => ("–".into(), "–".into(), "–".into()),
        };
        let ratio = r
            .baseline
            .and_then(|b| rows.iter().find(|x| x.name == b))
            .filter(|b| b.rate() > 0.0)
            .map(|b| format!("{:.2}× {}", r.rate() / b.rate(), b.name))
            .unwrap_or_else(|| "–".into());
        s.push_str(&format!(
            "| {} | {} | {:.2} | {:.0} | {p50} | {p99} | {p999} | {:.0} | {ratio} | {:.0} / {:.0} / {:.0} / {:.0} | {} |\n",
            r.name,
            r.events,
            r.secs,
            r.rate(),
            r.peak_rss_mb,
            r.cpu.me,
            r.cpu.pg,
            r.cpu.broker,
            r.cpu.machine,
            r.notes.join("; ")
        ));
    }
    s
}

/// Issue 15's table: the figure the issue was filed with, this run's figure and its
/// ratio to the same run's baseline, and the target, judged on the ratio.
pub(crate) fn targets_v2(rows: &[Row]) -> String {
    let find = |n: &str| rows.iter().find(|r| r.name == n);
    let ratio = |n: &str, base: &str| {
        let (r, b) = (find(n)?, find(base)?);
        (b.rate() > 0.0).then(|| (r, r.rate() / b.rate()))
    };
    let mut s = String::from(
        "| scenario | when filed | this run | target | met |\n|---|---|---|---|---|\n",
    );
    let mut line = |what: &str, filed: &str, now: Option<(String, bool)>, target: &str| {
        let (m, ok) = match now {
            Some((m, ok)) => (m, if ok { "yes" } else { "**no**" }),
            None => ("not run".into(), "–"),
        };
        s.push_str(&format!("| {what} | {filed} | {m} | {target} | {ok} |\n"));
    };
    let throughput = |n: &str, base: &str, min: f64| {
        ratio(n, base).map(|(r, x)| {
            let ordered = !n.contains("1-key")
                || r.notes
                    .iter()
                    .any(|n| n.starts_with("broker read-back complete"));
            let order = if !n.contains("1-key") {
                ""
            } else if ordered {
                ", order ok"
            } else {
                ", order NOT verified"
            };
            (
                format!("{:.0}/s ({x:.2}×){order}", r.rate()),
                x >= min && ordered,
            )
        })
    };
    // (scenario, figure when filed, row, baseline row, minimum ratio, target)
    let one_key = "≥ 0.15× raw produce to one key, order verified";
    for (what, filed, row, base, min, target) in [
        (
            "relay drain, 100,000 events over 1,000 keys",
            "23,461/s (0.07×)",
            "relay-1000-keys",
            "raw-kafka-1000-keys",
            0.3,
            "≥ 0.3× raw produce",
        ),
        (
            "relay drain, one key 100,000 deep",
            "10,450/s (0.03×)",
            "relay-1-key-deep",
            "raw-kafka-1-key",
            0.15,
            one_key,
        ),
        (
            "relay drain, one key 20,000 deep (not in the issue; for comparison)",
            "–",
            "relay-1-key",
            "raw-kafka-1-key",
            0.15,
            one_key,
        ),
        (
            "`EnqueueBatch` of 100, 16 clients",
            "64,158/s (0.43×)",
            "batch-100",
            "raw-pg-100-rows-per-stmt-c16",
            0.75,
            "≥ 0.75× raw multi-row inserts",
        ),
        (
            "`Enqueue`, 64 clients",
            "11,861/s (1.27×)",
            "enqueue-c64",
            "raw-pg-1-row-per-tx-c64",
            1.5,
            "≥ 1.5× raw 1-row transactions",
        ),
    ] {
        line(what, filed, throughput(row, base, min), target);
    }
    for (rate, max) in [(1_000, 20.0), (10_000, 50.0)] {
        let p99 = |n: &str| find(n).and_then(|r| r.latency.as_ref()).map(|l| l.p99);
        let floor = p99(&format!("raw-e2e-{rate}-per-s"))
            .map(|f| format!("; broker floor p99 {} ms", fmt_ms(f)))
            .unwrap_or_default();
        line(
            &format!("end to end at {rate}/s"),
            if rate == 1_000 { "p99 38 ms" } else { "–" },
            p99(&format!("e2e-{rate}-per-s"))
                .map(|p| (format!("p99 {} ms{floor}", fmt_ms(p)), p <= max)),
            &format!("p99 ≤ {max:.0} ms"),
        );
    }
    let wal = |n: &str| find(n).and_then(|r| r.wal_bytes);
    line(
        "WAL bytes per published event (enqueue + publish)",
        "unmeasured",
        wal("wal-enqueue+publish")
            .zip(wal("wal-raw-insert-100"))
            .filter(|(_, raw)| *raw > 0)
            .map(|(b, raw)| {
                let x = b as f64 / raw as f64;
                (format!("{:.2}× the raw insert's", x), x <= 2.0)
            }),
        "≤ 2× the raw insert's",
    );
    // The two volumes of the `retention` scenario, smaller first.
    let mut volumes: Vec<&Row> = rows
        .iter()
        .filter(|r| r.name.starts_with("retention-") && r.name[10..].parse::<u64>().is_ok())
        .collect();
    volumes.sort_by_key(|r| r.events);
    let retention = match volumes.as_slice() {
        [small, large, ..] => {
            let grows = large.secs / small.secs.max(1e-9);
            let drop = find(&format!("{}-drop", large.name))
                .map(|d| format!("; drop floor {:.1} ms", d.secs * 1e3))
                .unwrap_or_default();
            let us = |r: &Row| r.secs * 1e6 / r.events.max(1) as f64;
            Some((
                format!(
                    "{} events {:.0} ms, {} events {:.0} ms ({grows:.1}× for {:.0}× the volume; \
                     {:.1} and {:.1} µs/event){drop}",
                    small.events,
                    small.secs * 1e3,
                    large.events,
                    large.secs * 1e3,
                    large.events as f64 / small.events.max(1) as f64,
                    us(small),
                    us(large),
                ),
                // Independent of the volume: the larger day costs at most half again.
                grows <= 1.5,
            ))
        }
        _ => None,
    };
    line(
        "retention of a day of completed events",
        "batched DELETEs",
        retention,
        "cost independent of the day's volume",
    );
    s
}

/// The targets of issue 6, judged on this run's rows.
pub(crate) fn targets(rows: &[Row]) -> String {
    let find = |n: &str| rows.iter().find(|r| r.name == n);
    let mut s = String::from("| target | measured | met |\n|---|---|---|\n");
    let mut line = |target: &str, measured: Option<(String, bool)>| {
        let (m, ok) = match measured {
            Some((m, ok)) => (m, if ok { "yes" } else { "**no**" }),
            None => ("not run".into(), "–"),
        };
        s.push_str(&format!("| {target} | {m} | {ok} |\n"));
    };
    let rate =
        |n: &str, min: f64| find(n).map(|r| (format!("{:.0} events/s", r.rate()), r.rate() >= min));
    line(
        "Enqueue unary, 64 clients ≥ 10,000 events/s",
        rate("enqueue-c64", 10_000.0),
    );
    line(
        "EnqueueBatch of 100 ≥ 50,000 events/s",
        rate("batch-100", 50_000.0),
    );
    line(
        "Relay over 1,000 keys ≥ 20,000 events/s",
        rate("relay-1000-keys", 20_000.0),
    );
    line("Relay, a single key ≥ 5,000 events/s, order kept", {
        find("relay-1-key").map(|r| {
            let ordered = r
                .notes
                .iter()
                .any(|n| n.starts_with("broker read-back complete"));
            (
                format!(
                    "{:.0} events/s, {}",
                    r.rate(),
                    if ordered {
                        "order ok"
                    } else {
                        "order NOT verified"
                    }
                ),
                r.rate() >= 5_000.0 && ordered,
            )
        })
    });
    line(
        "Relay, a single key 100,000 deep ≥ 5,000 events/s, order kept",
        {
            find("relay-1-key-deep").map(|r| {
                let ordered = r
                    .notes
                    .iter()
                    .any(|n| n.starts_with("broker read-back complete"));
                (
                    format!(
                        "{:.0} events/s, {}",
                        r.rate(),
                        if ordered {
                            "order ok"
                        } else {
                            "order NOT verified"
                        }
                    ),
                    r.rate() >= 5_000.0 && ordered,
                )
            })
        },
    );
    line(
        "End to end at 1,000 events/s: p99 ≤ 50 ms",
        find("e2e-1000-per-s")
            .and_then(|r| r.latency.as_ref())
            .map(|l| (format!("p99 {} ms", fmt_ms(l.p99)), l.p99 <= 50.0)),
    );
    line(
        "ListPending top 100 over 1,000,000 pending ≤ 200 ms",
        find("list-pending")
            .and_then(|r| r.latency.as_ref())
            .map(|l| {
                (
                    format!("p50 {} ms, max {} ms", fmt_ms(l.p50), fmt_ms(l.max)),
                    l.p50 <= 200.0,
                )
            }),
    );
    let mailroom_rows: Vec<&Row> = rows
        .iter()
        .filter(|r| !r.name.starts_with("raw-"))
        .collect();
    line(
        "Peak RSS under these loads ≤ 150 MB",
        mailroom_rows
            .iter()
            .map(|r| r.peak_rss_mb)
            .reduce(f64::max)
            .map(|m| {
                (
                    format!("{m:.0} MB (max over mailroom scenarios)"),
                    m <= 150.0,
                )
            }),
    );
    s
}

#[derive(Default)]
pub(crate) struct Load {
    pub(crate) events: u64,
    pub(crate) errors: u64,
    pub(crate) elapsed: Duration,
    pub(crate) lat_us: Vec<u64>,
    pub(crate) first_error: Option<String>,
}

pub(crate) async fn drive<F, Fut>(clients: usize, duration: Duration, op: F) -> Load
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<u64>> + Send + 'static,
{
    let op = Arc::new(op);
    let start = Instant::now();
    let deadline = start + duration;
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let op = op.clone();
            tokio::spawn(async move {
                let mut l = Load::default();
                let mut seq = 0;
                while Instant::now() < deadline {
                    let t = Instant::now();
                    match op(c, seq).await {
                        Ok(n) => {
                            l.events += n;
                            l.lat_us.push(t.elapsed().as_micros() as u64);
                        }
                        Err(e) => {
                            l.errors += 1;
                            l.first_error.get_or_insert_with(|| format!("{e:#}"));
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                    seq += 1;
                }
                l
            })
        })
        .collect();
    let mut total = Load::default();
    for t in tasks {
        let l = t.await.expect("load task");
        total.events += l.events;
        total.errors += l.errors;
        total.lat_us.extend(l.lat_us);
        if total.first_error.is_none() {
            total.first_error = l.first_error;
        }
    }
    total.elapsed = start.elapsed();
    total
}

pub(crate) fn load_row(name: &str, load: Load, cpu: CpuUse, baseline: Option<&'static str>) -> Row {
    let mut notes = Vec::new();
    if load.errors > 0 {
        notes.push(format!(
            "{} errors (first: {})",
            load.errors,
            load.first_error.unwrap_or_default()
        ));
    }
    Row {
        name: name.into(),
        events: load.events,
        secs: load.elapsed.as_secs_f64(),
        latency: latency(load.lat_us),
        peak_rss_mb: mb(status_kb("VmHWM:")),
        cpu,
        baseline,
        notes,
        wal_bytes: None,
    }
}
