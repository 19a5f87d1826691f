//! Validation and conversion of `RewindSubscription` and `ListRewinds`.

use super::requests::request_id;
use crate::domain::admin::{ActionContext, Rewind, RewindRequest};
use crate::error::{Error, FieldViolation};
use crate::pb;
use crate::pb::time::{timestamp, to_timestamp};

/// Validates a `RewindSubscription` request: a configured subscription, a time not in
/// the future; without `confirm` a dry run.
pub fn rewind_request(
    r: pb::RewindSubscriptionRequest,
    context: ActionContext,
    configured: &[String],
) -> Result<RewindRequest, Error> {
    let mut v = Vec::new();
    if r.subscription.trim().is_empty() {
        v.push(FieldViolation::new("subscription", "is required"));
    }
    let to_time = match r.to_time.as_ref().map(timestamp) {
        None => {
            v.push(FieldViolation::new("to_time", "is required"));
            None
        }
        Some(None) => {
            v.push(FieldViolation::new("to_time", "is not a valid timestamp"));
            None
        }
        Some(Some(t)) if t > chrono::Utc::now() + chrono::Duration::seconds(5) => {
            v.push(FieldViolation::new(
                "to_time",
                "is in the future: a rewind goes back",
            ));
            None
        }
        Some(Some(t)) => Some(t),
    };
    let rid = match request_id(r.request_id) {
        Ok(rid) => rid,
        Err(Error::InvalidArgument(mut more)) => {
            v.append(&mut more);
            None
        }
        Err(e) => return Err(e),
    };
    let (Some(to_time), true) = (to_time, v.is_empty()) else {
        return Err(Error::InvalidArgument(v));
    };
    if !configured.contains(&r.subscription) {
        return Err(Error::NotFound(format!(
            "no subscription named {:?} is configured on this service",
            r.subscription
        )));
    }
    Ok(RewindRequest {
        subscription: r.subscription,
        to_time,
        redeliver: r.redeliver,
        context: ActionContext {
            dry_run: !r.confirm,
            request_id: rid,
            ..context
        },
    })
}

/// A rewind as the API shows it.
pub fn rewind_info(r: Rewind) -> pb::Rewind {
    pb::Rewind {
        id: r.id,
        subscription: r.subscription,
        to_time: Some(to_timestamp(r.to_time)),
        redeliver: r.redeliver,
        actor: r.actor,
        principal: r.principal.unwrap_or_default(),
        created_at: Some(to_timestamp(r.created_at)),
        partitions: r
            .partitions
            .into_iter()
            .map(|p| pb::RewindPartition {
                topic: p.topic,
                partition: p.partition,
                from_offset: p.from_offset,
                until_offset: p.until_offset,
                applied_at: p.applied_at.map(to_timestamp),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rewind_names_a_configured_subscription_and_a_past_time() {
        let subs = vec!["billing".to_string()];
        let ok = pb::RewindSubscriptionRequest {
            subscription: "billing".into(),
            to_time: Some(to_timestamp(
                chrono::Utc::now() - chrono::Duration::hours(1),
            )),
            ..Default::default()
        };
        let r = rewind_request(ok.clone(), ActionContext::by("ops"), &subs).unwrap();
        assert!(r.context.dry_run && !r.redeliver);
        let field = |r: pb::RewindSubscriptionRequest| match rewind_request(
            r,
            ActionContext::by("ops"),
            &subs,
        ) {
            Err(Error::InvalidArgument(v)) => v[0].field.clone(),
            other => format!("{other:?}"),
        };
        assert_eq!(
            field(pb::RewindSubscriptionRequest {
                to_time: None,
                ..ok.clone()
            }),
            "to_time"
        );
        let future = Some(to_timestamp(
            chrono::Utc::now() + chrono::Duration::hours(1),
        ));
        assert_eq!(
            field(pb::RewindSubscriptionRequest {
                to_time: future,
                ..ok.clone()
            }),
            "to_time"
        );
        assert_eq!(
            field(pb::RewindSubscriptionRequest {
                subscription: String::new(),
                ..ok.clone()
            }),
            "subscription"
        );
        let unknown = rewind_request(
            pb::RewindSubscriptionRequest {
                subscription: "x".into(),
                ..ok
            },
            ActionContext::by("ops"),
            &subs,
        );
        assert!(matches!(unknown, Err(Error::NotFound(_))), "{unknown:?}");
    }
}
