//! `mailroom admin --subscription S rewind --to T` and `rewinds`.

use serde_json::{Value, json};

use super::AdminCommand;
use super::client::{Client, Target, answer, operator, request_id};
use super::render::{Table, lines, ts};
use crate::pb;
use crate::pb::time::to_timestamp;

pub(super) async fn run(
    c: &mut Client,
    t: &Target,
    command: AdminCommand,
) -> anyhow::Result<String> {
    match command {
        AdminCommand::Rewind {
            to,
            redeliver,
            yes,
            request_id: rid,
            operator: who,
        } => {
            if t.sub.is_empty() {
                anyhow::bail!("rewind needs --subscription NAME");
            }
            let req = pb::RewindSubscriptionRequest {
                subscription: t.sub.clone(),
                to_time: Some(to_timestamp(to)),
                redeliver,
                confirm: yes,
                operator: operator(who),
                request_id: request_id(rid),
            };
            let r = answer(c.inner.rewind_subscription(c.req(req)).await)?;
            Ok(rewind_out(&r, &t.sub, t.json))
        }
        AdminCommand::Rewinds { limit } => {
            let req = pb::ListRewindsRequest {
                subscription: t.sub.clone(),
                page_size: limit,
            };
            let r = answer(c.inner.list_rewinds(c.req(req)).await)?;
            Ok(rewinds_out(&r, t.json))
        }
        _ => unreachable!("dispatched by execute"),
    }
}

fn rewind_json(r: &pb::Rewind) -> Value {
    json!({
        "id": r.id,
        "subscription": r.subscription,
        "to_time": ts(r.to_time.as_ref()),
        "redeliver": r.redeliver,
        "actor": r.actor,
        "principal": r.principal,
        "created_at": ts(r.created_at.as_ref()),
        "partitions": r.partitions.iter().map(|p| json!({
            "topic": p.topic,
            "partition": p.partition,
            "from_offset": p.from_offset,
            "until_offset": p.until_offset,
            "applied_at": ts(p.applied_at.as_ref()),
        })).collect::<Vec<_>>(),
    })
}

fn rewind_out(r: &pb::RewindSubscriptionResponse, sub: &str, json_out: bool) -> String {
    if json_out {
        return lines(&json!({
            "dry_run": r.dry_run,
            "replayed": r.replayed,
            "stored_since": r.stored_since,
            "audit_id": r.audit_id,
            "rewind": r.rewind.as_ref().map(rewind_json),
        }));
    }
    match &r.rewind {
        None => format!(
            "dry run: {sub} has {} message(s) stored since then; its consumers would read them again \
             (and any record not stored or no longer retained)\nrun again with --yes to rewind\n",
            r.stored_since
        ),
        Some(w) => format!(
            "rewind {} of {sub} to {} asked for{}{}; consumers apply it within seconds: mailroom admin --subscription {sub} rewinds\n",
            w.id,
            ts(w.to_time.as_ref()).unwrap_or_default(),
            if w.redeliver { " (redeliver)" } else { "" },
            if r.replayed {
                " (this request id asked for it before: nothing new)"
            } else {
                ""
            }
        ),
    }
}

fn rewinds_out(r: &pb::ListRewindsResponse, json_out: bool) -> String {
    if json_out {
        return lines(&json!({ "rewinds": r.rewinds.iter().map(rewind_json).collect::<Vec<_>>() }));
    }
    let mut t = Table::new(&[
        "ID",
        "SUBSCRIPTION",
        "TO",
        "REDELIVER",
        "ACTOR",
        "TOPIC",
        "PARTITION",
        "FROM",
        "UNTIL",
        "APPLIED",
    ]);
    for w in &r.rewinds {
        let head = |t: &mut Table, rest: [String; 5]| {
            let mut row = vec![
                w.id.to_string(),
                w.subscription.clone(),
                ts(w.to_time.as_ref()).unwrap_or_default(),
                if w.redeliver { "yes" } else { "no" }.into(),
                w.actor.clone(),
            ];
            row.extend(rest);
            t.row(row);
        };
        if w.partitions.is_empty() {
            head(
                &mut t,
                [
                    "-".into(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                    "not yet".into(),
                ],
            );
        }
        for p in &w.partitions {
            head(
                &mut t,
                [
                    p.topic.clone(),
                    p.partition.to_string(),
                    p.from_offset.to_string(),
                    p.until_offset.to_string(),
                    ts(p.applied_at.as_ref()).unwrap_or_else(|| "applying".into()),
                ],
            );
        }
    }
    t.render()
}
