//! A checker for text expositions, used by the tests on real scrapes: every histogram
//! cumulative once, its `+Inf` bucket equal to its `_count`.

use std::collections::{BTreeMap, HashSet};

/// Checks every histogram of a text exposition: per series (labels other than `le`),
/// bucket counts never decrease with `le`, a `+Inf` bucket exists and equals `_count`.
/// Returns the number of series checked, or the problems found.
pub fn check_histograms(text: &str) -> Result<usize, Vec<String>> {
    let mut problems = Vec::new();
    let series = histogram_series(text, &mut problems);
    for ((name, labels), (buckets, count)) in &series {
        check_series(
            &format!("{name}{{{labels}}}"),
            buckets,
            *count,
            &mut problems,
        );
    }
    if problems.is_empty() {
        Ok(series.len())
    } else {
        Err(problems)
    }
}

/// A histogram series' buckets (`le`, cumulative count) and its `_count`.
type Series = (Vec<(f64, f64)>, Option<f64>);

/// The names the exposition declares as histograms.
fn histogram_names(text: &str) -> HashSet<String> {
    let mut histograms = HashSet::new();
    for l in text.lines() {
        let mut w = l.split_whitespace();
        if let (Some("#"), Some("TYPE"), Some(name), Some("histogram")) =
            (w.next(), w.next(), w.next(), w.next())
        {
            histograms.insert(name.to_string());
        }
    }
    histograms
}

/// The histograms' samples by (name, labels other than `le`); unparsable samples go to
/// `problems`.
fn histogram_series(text: &str, problems: &mut Vec<String>) -> BTreeMap<(String, String), Series> {
    let histograms = histogram_names(text);
    let mut series: BTreeMap<(String, String), Series> = BTreeMap::new();
    for l in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let Some((head, value)) = l.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            problems.push(format!("unparsable sample: {l}"));
            continue;
        };
        let (name, labels) = match head.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (head, ""),
        };
        let Some((base, suffix)) = name.rsplit_once('_') else {
            continue;
        };
        if !histograms.contains(base) {
            continue;
        }
        let mut le = None;
        let others: Vec<&str> = labels
            .split(',')
            .filter(|p| !p.is_empty())
            .filter(|p| match p.strip_prefix("le=") {
                Some(v) => {
                    le = Some(v.trim_matches('"').to_string());
                    false
                }
                None => true,
            })
            .collect();
        let entry = series
            .entry((base.to_string(), others.join(",")))
            .or_default();
        match (suffix, le) {
            ("bucket", Some(le)) => {
                let bound = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap_or(f64::NAN)
                };
                entry.0.push((bound, value));
            }
            ("count", None) => entry.1 = Some(value),
            _ => {}
        }
    }
    series
}

/// One series: cumulative buckets, and a `+Inf` bucket equal to `_count`.
fn check_series(id: &str, buckets: &[(f64, f64)], count: Option<f64>, problems: &mut Vec<String>) {
    let mut buckets = buckets.to_vec();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    if buckets.windows(2).any(|w| w[1].1 < w[0].1) {
        problems.push(format!("{id}: bucket counts decrease: {buckets:?}"));
    }
    match (buckets.last(), count) {
        (Some((b, inf)), Some(c)) if b.is_infinite() => {
            if *inf != c {
                problems.push(format!("{id}: +Inf bucket {inf} != _count {c}"));
            }
        }
        _ => problems.push(format!("{id}: no +Inf bucket or no _count")),
    }
}
