//! The shipped alerting rules (`deploy/prometheus/mailroom-alerts.yml`, issue 44, item 3)
//! evaluated against a running service's real `/metrics`: every series a rule reads is
//! exported, no rule fires on a healthy service, and the rules for failures and for a
//! closed schema gate fire once those happen. The evaluator below covers the PromQL the
//! rules use (an aggregation of a selector or of `increase(selector[range])`, compared
//! with a number); `increase` is the difference between two scrapes, and `for` is not
//! evaluated (it delays a firing alert, it never makes one).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::support::probe::scrape;
use crate::support::*;
use mailroom::domain::{BoxKind, Status};

/// A scrape's series (name and sorted labels) to value, and the metric families it
/// declares (`# TYPE`), with or without series.
#[derive(Default)]
struct Scrape {
    series: BTreeMap<(String, BTreeMap<String, String>), f64>,
    families: std::collections::HashSet<String>,
}

impl Scrape {
    /// Whether `metric` (a counter's `_total` series too) is declared.
    fn declares(&self, metric: &str) -> bool {
        self.families.contains(metric)
            || metric
                .strip_suffix("_total")
                .is_some_and(|f| self.families.contains(f))
    }

    fn iter(&self) -> impl Iterator<Item = (&(String, BTreeMap<String, String>), &f64)> {
        self.series.iter()
    }
}

fn parse_scrape(text: &str) -> Scrape {
    let mut out = Scrape::default();
    let body = text.split("\r\n\r\n").nth(1).unwrap_or(text);
    for line in body.lines() {
        if let Some(t) = line.strip_prefix("# TYPE ") {
            out.families
                .insert(t.split(' ').next().unwrap_or("").to_string());
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        // Chunk sizes and headers have no "series value" shape.
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let (name, labels) = match series.split_once('{') {
            None => (series.to_string(), BTreeMap::new()),
            Some((n, rest)) => (n.to_string(), parse_labels(rest.trim_end_matches('}'))),
        };
        out.series.insert((name, labels), value);
    }
    out
}

/// `a="x",b="y"` (values without commas or quotes, as mailroom's are in these tests).
fn parse_labels(s: &str) -> BTreeMap<String, String> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').expect("label=value");
            (k.to_string(), v.trim_matches('"').to_string())
        })
        .collect()
}

/// A rule's expression: `agg(inner) op threshold`.
#[derive(Debug)]
struct Expr {
    agg: String,
    increase: bool,
    metric: String,
    /// (label, regex?, values): `=` is one value, `=~` alternatives split on `|`.
    matchers: Vec<(String, Vec<String>)>,
    op: String,
    threshold: f64,
}

fn parse_expr(e: &str) -> Expr {
    let e = e.trim();
    let (agg, rest) = e.split_once('(').expect("an aggregation");
    let close = rest.rfind(')').expect("closing parenthesis");
    let (inner, tail) = (&rest[..close], rest[close + 1..].trim());
    let (op, threshold) = tail.split_once(' ').expect("op threshold");
    let (increase, selector) = match inner.strip_prefix("increase(") {
        Some(i) => {
            let i = i.trim_end_matches(')');
            let bracket = i.rfind('[').expect("a range");
            (true, &i[..bracket])
        }
        None => (false, inner),
    };
    let (metric, matchers) = match selector.split_once('{') {
        None => (selector.to_string(), Vec::new()),
        Some((m, rest)) => {
            let ms = rest
                .trim_end_matches('}')
                .split(',')
                .map(|p| {
                    let (k, v) = if let Some((k, v)) = p.split_once("=~") {
                        (
                            k,
                            v.trim_matches('"').split('|').map(String::from).collect(),
                        )
                    } else {
                        let (k, v) = p.split_once('=').expect("matcher");
                        (k, vec![v.trim_matches('"').to_string()])
                    };
                    (k.trim().to_string(), v)
                })
                .collect();
            (m.to_string(), ms)
        }
    };
    assert!(
        ["sum", "max"].contains(&agg.trim()),
        "unsupported aggregation in {e}"
    );
    Expr {
        agg: agg.trim().into(),
        increase,
        metric,
        matchers,
        op: op.into(),
        threshold: threshold.trim().parse().expect("a number"),
    }
}

/// The series of `s` that `x`'s selector matches.
fn matching(x: &Expr, s: &Scrape) -> BTreeMap<BTreeMap<String, String>, f64> {
    s.iter()
        .filter(|((name, labels), _)| {
            *name == x.metric
                && x.matchers
                    .iter()
                    .all(|(k, vs)| labels.get(k).is_some_and(|v| vs.contains(v)))
        })
        .map(|((_, labels), v)| (labels.clone(), *v))
        .collect()
}

/// Whether the rule fires between the scrapes `before` and `now`. A metric without
/// series fires nothing, as in PromQL (a gauge family is exported once it has a series);
/// the test asserts that each rule's metric shows in one of its scrapes.
fn fires(x: &Expr, before: &Scrape, now: &Scrape) -> bool {
    let cur = matching(x, now);
    if cur.is_empty() {
        return false;
    }
    let values: Vec<f64> = if x.increase {
        let prev = matching(x, before);
        cur.iter()
            .map(|(l, v)| v - prev.get(l).copied().unwrap_or(0.0))
            .collect()
    } else {
        cur.values().copied().collect()
    };
    let v = match x.agg.as_str() {
        "sum" => values.iter().sum(),
        _ => values.iter().copied().fold(f64::MIN, f64::max),
    };
    match x.op.as_str() {
        ">" => v > x.threshold,
        "<" => v < x.threshold,
        ">=" => v >= x.threshold,
        "==" => v == x.threshold,
        op => panic!("unsupported operator {op}"),
    }
}

fn rules() -> Vec<(String, Expr)> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/prometheus/mailroom-alerts.yml");
    let doc: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut out = Vec::new();
    for g in doc["groups"].as_sequence().expect("groups") {
        for r in g["rules"].as_sequence().expect("rules") {
            let name = r["alert"].as_str().expect("alert").to_string();
            let expr = parse_expr(r["expr"].as_str().expect("expr"));
            out.push((name, expr));
        }
    }
    out
}

fn firing(rules: &[(String, Expr)], before: &Scrape, now: &Scrape) -> Vec<String> {
    rules
        .iter()
        .filter(|(_, x)| fires(x, before, now))
        .map(|(n, _)| n.clone())
        .collect()
}

/// A healthy service fires nothing; an outbox event that fails (an injected counted
/// failure), an inbox message its handler refuses and a database that requires a newer
/// schema fire exactly the rules written for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_alert_rules_fire_on_what_they_are_for() {
    let rules = rules();
    assert!(rules.len() >= 6, "{rules:?}");
    let handler =
        crate::support::handler::Recorder::<crate::support::handler::RejectAll>::default();
    let url = handler.serve().await;
    let db = fresh_pg().await;
    let out = tempfile::tempdir().unwrap();
    let mut c = config(&db);
    c.sink = mailroom::sink::SinkConfig::Local {
        path: Some(out.path().join("sink.jsonl")),
    };
    c.faults = (1.0, 0.0);
    c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    c.metrics_stats_interval = Duration::from_millis(100);
    c.subscriptions = vec![crate::support::subscription("billing", &[], &url)];
    let mut s = Service::start(c).await;
    let maddr = s.app.metrics_addr.unwrap();
    let healthy = parse_scrape(&scrape(maddr).await);
    assert_eq!(
        firing(&rules, &healthy, &healthy),
        Vec::<String>::new(),
        "a healthy service"
    );

    let mut e = event("alerts.t", "k", b"x");
    e.max_attempts = 1;
    let id = enqueue(&mut s.client, e).await;
    let mut ic = inbox_client(&s).await;
    let msg = receive(&mut ic, "billing", "a-1", "k", "x").await.id;
    eventually(Duration::from_secs(20), "both failed", || {
        let s = &s;
        async move {
            s.stored(BoxKind::Outbox, id).await.status == Status::Failed
                && s.stored(BoxKind::Inbox, msg).await.status == Status::Failed
        }
    })
    .await;
    eventually(
        Duration::from_secs(10),
        "the gauges refreshed",
        || async move {
            let now = parse_scrape(&scrape(maddr).await);
            now.iter()
                .any(|((n, _), v)| n == "mailroom_outbox_failed_events" && *v > 0.0)
        },
    )
    .await;
    let failing = parse_scrape(&scrape(maddr).await);
    let mut got = firing(&rules, &healthy, &failing);
    got.sort();
    assert_eq!(
        got,
        [
            "MailroomFailedEventsKept",
            "MailroomFailedEventsRising",
            "MailroomInboxFailedRising"
        ],
        "after the failures"
    );

    // A newer release's requirement: the gate closes.
    exec(
        &db,
        "INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (9999, 9999)",
    )
    .await;
    eventually(Duration::from_secs(20), "the gate alert", || {
        let rules = &rules;
        let failing = &failing;
        async move {
            let now = parse_scrape(&scrape(maddr).await);
            firing(rules, failing, &now).contains(&"MailroomSchemaGateClosed".to_string())
        }
    })
    .await;
    let gated = parse_scrape(&scrape(maddr).await);
    for (name, x) in &rules {
        assert!(
            [&healthy, &failing, &gated]
                .iter()
                .any(|s| s.declares(&x.metric)),
            "{name}: {} is never exported",
            x.metric
        );
    }
    exec(
        &db,
        "DELETE FROM mailroom_schema_compat WHERE version = 9999",
    )
    .await;
    s.app.stop().await.unwrap();
}
