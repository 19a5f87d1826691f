//! Logs, and optional OTLP trace export. Logs go to stderr (human or JSON). With an OTLP
//! endpoint configured, spans are also exported over OTLP/gRPC; spans that start from a
//! W3C `traceparent` (an `Enqueue` call that carried one, a Kafka publish or an inbox
//! handler call for a message that has one) join the producer's trace, and the spans of
//! mailroom's own calls (a Kafka producer span, an inbox handler's client span) become
//! the receiver's parent through [`inject`]. Off by default. JSON logs carry the
//! `trace_id` and `span_id` of the span each line was logged in (with or without an
//! exporter: without one, spans get ids but are neither exported nor propagated).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// One readable line per event, control characters escaped.
    Human,
    /// One JSON object per line.
    Json,
}

/// Which OpenTelemetry RPC conventions the spans follow (`OTEL_SEMCONV_STABILITY_OPT_IN`,
/// as the conventions ask of instrumentations that emitted v1.37.0): by default the
/// v1.37.0 attributes (`rpc.system`, `rpc.service`, `rpc.method` = the method's short
/// name, `rpc.grpc.status_code`) with the newer ones that do not clash
/// (`rpc.system.name`, `rpc.response.status_code`); with `rpc` in the variable, only
/// the newer ones (and `rpc.method` fully qualified, `package.Service/Method`).
pub fn rpc_stable_only() -> bool {
    static STABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *STABLE.get_or_init(|| {
        std::env::var("OTEL_SEMCONV_STABILITY_OPT_IN").is_ok_and(|v| stable_rpc_opt_in(&v))
    })
}

/// Whether an `OTEL_SEMCONV_STABILITY_OPT_IN` value asks for the stable RPC conventions
/// only (`rpc`; `rpc/dup` keeps both, which is the default here).
fn stable_rpc_opt_in(value: &str) -> bool {
    let items: Vec<&str> = value.split(',').map(str::trim).collect();
    items.contains(&"rpc") && !items.contains(&"rpc/dup")
}

/// Records an RPC span's identity (`service` `package.Service`, `method` its short
/// name) under the conventions [`rpc_stable_only`] chose; the span declares the fields
/// `rpc.system`, `rpc.service`, `rpc.method` and `rpc.system.name` empty.
pub fn record_rpc(span: &tracing::Span, service: &str, method: &str) {
    span.record("rpc.system.name", "grpc");
    if rpc_stable_only() {
        span.record("rpc.method", format!("{service}/{method}"));
    } else {
        span.record("rpc.system", "grpc");
        span.record("rpc.service", service);
        span.record("rpc.method", method);
    }
}

/// Records an RPC span's status code: `rpc.response.status_code` as gRPC names it and,
/// unless only the stable conventions are asked for, the numeric `rpc.grpc.status_code`.
pub fn record_rpc_code(span: &tracing::Span, code: tonic::Code) {
    span.record("rpc.response.status_code", crate::pb::code_name(code));
    if !rpc_stable_only() {
        span.record("rpc.grpc.status_code", code as i64);
    }
}

/// Whether spans are exported: only then does [`inject`] hand mailroom's span ids to
/// receivers (a span nobody can see would break the receiver's link to the producer).
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// JSON log lines with the OpenTelemetry ids of the span they were logged in
/// (`trace_id`, `span_id`, as W3C hex), so that a log search and a trace view join.
struct TracedJson<F>(F);

impl<S, N, F> tracing_subscriber::fmt::FormatEvent<S, N> for TracedJson<F>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'w> tracing_subscriber::fmt::FormatFields<'w> + 'static,
    F: tracing_subscriber::fmt::FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        // The ids first: reading them locks the span's extensions, which the inner
        // format holds while it writes the span's fields.
        let ids = current_ids();
        let mut line = String::new();
        self.0.format_event(
            ctx,
            tracing_subscriber::fmt::format::Writer::new(&mut line),
            event,
        )?;
        match (ids, line.rfind('}')) {
            (Some((trace, span)), Some(end)) => {
                writer.write_str(&line[..end])?;
                write!(writer, ",\"trace_id\":\"{trace}\",\"span_id\":\"{span}\"")?;
                writer.write_str(&line[end..])
            }
            _ => writer.write_str(&line),
        }
    }
}

/// The current span's trace and span ids, when it has valid ones.
fn current_ids() -> Option<(String, String)> {
    use opentelemetry::trace::TraceContextExt as _;
    let span = tracing::Span::current();
    if span.is_none() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid()
        .then(|| (sc.trace_id().to_string(), sc.span_id().to_string()))
}

/// Keeps the exporter alive; `shutdown` flushes the spans still buffered.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Flushes the buffered spans and stops the exporter; a failure is printed to stderr.
    pub fn shutdown(self) {
        if let Some(p) = self.provider
            && let Err(e) = p.shutdown()
        {
            eprintln!("mailroom: flushing OTLP spans failed: {e}");
        }
    }
}

/// Installs the global subscriber. Must run inside the Tokio runtime (the exporter's
/// batch processor runs on it).
pub fn init(format: LogFormat, otlp_endpoint: Option<&str>) -> anyhow::Result<Telemetry> {
    // RUST_LOG filters the logs only: exported spans have their own filter (info and
    // above, or `MAILROOM_TRACE_FILTER` when set), so that
    // quieting the logs never silences the traces.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
        .add_directive(no_record_spans());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = match format {
        LogFormat::Human => fmt.fmt_fields(human_fields()).with_filter(filter).boxed(),
        LogFormat::Json => fmt
            .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
            .event_format(TracedJson(tracing_subscriber::fmt::format().json()))
            .with_filter(filter)
            .boxed(),
    };
    let provider = match export_endpoint(otlp_endpoint, |k| std::env::var(k).ok()) {
        None => None,
        Some(endpoint) => {
            use opentelemetry_otlp::WithTonicConfig as _;
            let mut builder = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint.clone());
            if endpoint.starts_with("https://") {
                builder = builder.with_tls_config(collector_tls(|k| std::env::var(k).ok())?);
            }
            let exporter = builder.build()?;
            let processor =
                opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
                    exporter,
                    opentelemetry_sdk::runtime::Tokio,
                )
                .build();
            // The resource honours OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; the
            // sampler OTEL_TRACES_SAMPLER (the SDK's defaults read them).
            let mut resource = opentelemetry_sdk::Resource::builder();
            if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
                resource = resource.with_service_name("mailroom");
            }
            Some(
                SdkTracerProvider::builder()
                    .with_span_processor(processor)
                    .with_resource(resource.build())
                    .build(),
            )
        }
    };
    EXPORTING.store(provider.is_some(), Ordering::Relaxed);
    // JSON logs name each line's trace and span: spans need OpenTelemetry ids even when
    // nothing exports them (a provider without a processor records nothing).
    let provider = match (provider, format) {
        (None, LogFormat::Json) => Some(SdkTracerProvider::builder().build()),
        (p, _) => p,
    };
    let mut trace_filter = std::env::var("MAILROOM_TRACE_FILTER")
        .ok()
        .and_then(|f| tracing_subscriber::EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new("info"));
    if !EXPORTING.load(Ordering::Relaxed) {
        // Spans only name JSON log lines here; no log line is written inside a record's.
        trace_filter = trace_filter.add_directive(no_record_spans());
    }
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("mailroom"))
            .with_filter(trace_filter)
    });
    tracing_subscriber::registry()
        .with(fmt)
        .with(otel)
        .try_init()?;
    Ok(Telemetry { provider })
}

/// The target of the spans made for each record (the outbox's producer span, `send`):
/// exported over OTLP, never formatted into log lines. The log formatter writes every
/// field of every span it is given as the span opens, and one span per record cost the
/// relay more CPU than handing the record to librdkafka did (docs/benchmarks.md).
pub const RECORD_SPANS: &str = "mailroom::record";

/// The filter directive that leaves the per-record spans out.
fn no_record_spans() -> tracing_subscriber::filter::Directive {
    format!("{RECORD_SPANS}=off")
        .parse()
        .expect("a valid directive")
}

/// Where spans are exported: `MAILROOM_OTLP_ENDPOINT`, else OpenTelemetry's own
/// TLS to an `https://` collector, from OpenTelemetry's variables (the traces-specific
/// one first): the CA that verifies the collector (`OTEL_EXPORTER_OTLP_CERTIFICATE`,
/// else the webpki roots) and, for mTLS, the client certificate and key
/// (`OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE`, `OTEL_EXPORTER_OTLP_CLIENT_KEY`), PEM files.
fn collector_tls(
    env: impl Fn(&str) -> Option<String>,
) -> anyhow::Result<tonic::transport::ClientTlsConfig> {
    let var = |name: &str| {
        env(&format!("OTEL_EXPORTER_OTLP_TRACES_{name}"))
            .or_else(|| env(&format!("OTEL_EXPORTER_OTLP_{name}")))
            .filter(|v| !v.is_empty())
            .map(std::path::PathBuf::from)
    };
    crate::tls::ClientTls {
        ca: var("CERTIFICATE"),
        cert: var("CLIENT_CERTIFICATE"),
        key: var("CLIENT_KEY"),
    }
    .tonic()
}

/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`; never when
/// `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`.
pub fn export_endpoint(
    configured: Option<&str>,
    env: impl Fn(&str) -> Option<String>,
) -> Option<String> {
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
        || env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"))
    {
        return None;
    }
    configured
        .map(str::to_string)
        .or_else(|| env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        .or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"))
        .filter(|e| !e.trim().is_empty())
}

/// The human log format's field formatter: like the default (`message key=value …`),
/// but control characters in values (caller-supplied strings: topics, keys, subscription
/// names, operator names) are escaped, so that a value cannot forge a log line or send
/// terminal escape sequences.
pub fn human_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> + 'static {
    use tracing_subscriber::field::MakeExt as _;
    tracing_subscriber::fmt::format::debug_fn(|w, field, value| {
        use std::fmt::Write as _;
        let mut e = Escaping(w);
        if field.name() == "message" {
            write!(e, "{value:?}")
        } else {
            write!(e, "{field}={value:?}")
        }
    })
    .delimited(" ")
}

struct Escaping<'a, 'w>(&'a mut tracing_subscriber::fmt::format::Writer<'w>);

impl std::fmt::Write for Escaping<'_, '_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        for c in s.chars() {
            if c.is_control() {
                write!(self.0, "{}", c.escape_default())?;
            } else {
                self.0.write_char(c)?;
            }
        }
        Ok(())
    }
}

/// Makes `span` a child of the W3C `traceparent` given, with its `tracestate`, when it is
/// well formed (a no-op without an OTLP exporter).
pub fn join_trace_state(span: &tracing::Span, traceparent: Option<&str>, tracestate: Option<&str>) {
    if let Some(tp) = traceparent {
        let mut carrier = HashMap::from([("traceparent".to_string(), tp.to_string())]);
        if let Some(ts) = tracestate {
            carrier.insert("tracestate".to_string(), ts.to_string());
        }
        let cx = TraceContextPropagator::new().extract(&carrier);
        let _ = span.set_parent(cx);
    }
}

/// A database client span (OpenTelemetry database conventions): `summary` is its name
/// and `db.query.summary` (`INSERT outbox_events`), `operation` its `db.operation.name`,
/// `table` its `db.collection.name`; `engine` the store's (`postgres`, `sqlite`). A
/// transaction of several statements carries the summary of what it does.
pub fn db_span(
    level: tracing::Level,
    engine: &str,
    summary: &str,
    operation: &str,
    table: &str,
    batch: usize,
) -> tracing::Span {
    let system = if engine == "postgres" {
        "postgresql"
    } else {
        engine
    };
    macro_rules! db_span {
        ($level:expr) => {
            tracing::span!(
                $level,
                "db",
                otel.name = %summary,
                otel.kind = "client",
                db.system.name = %system,
                db.query.summary = %summary,
                db.operation.name = %operation,
                db.collection.name = %table,
                db.operation.batch.size = batch,
            )
        };
    }
    if level == tracing::Level::INFO {
        db_span!(tracing::Level::INFO)
    } else {
        db_span!(tracing::Level::DEBUG)
    }
}

/// Links `span` to `caller`'s span (a request a batched store call serves), when spans
/// are exported.
pub fn link_span(span: &tracing::Span, caller: &tracing::Span) {
    use opentelemetry::trace::TraceContextExt as _;
    if !EXPORTING.load(Ordering::Relaxed) || caller.is_none() {
        return;
    }
    let sc = caller.context().span().span_context().clone();
    if sc.is_valid() {
        span.add_link(sc);
    }
}

/// Links `span` to the trace context of a W3C `traceparent` (a consumed record's
/// producer), when spans are exported and the header is well formed.
pub fn link_to(span: &tracing::Span, traceparent: Option<&str>, tracestate: Option<&str>) {
    use opentelemetry::trace::TraceContextExt as _;
    let (true, Some(tp)) = (EXPORTING.load(Ordering::Relaxed), traceparent) else {
        return;
    };
    let mut carrier = HashMap::from([("traceparent".to_string(), tp.to_string())]);
    if let Some(ts) = tracestate {
        carrier.insert("tracestate".to_string(), ts.to_string());
    }
    let cx = TraceContextPropagator::new().extract(&carrier);
    let sc = cx.span().span_context().clone();
    if sc.is_valid() {
        span.add_link(sc);
    }
}

/// The W3C headers (`traceparent`, and `tracestate` when there is one) that make a
/// receiver a child of `span`; `None` when spans are not exported (then the producer's
/// own headers travel on unchanged).
pub fn inject(span: &tracing::Span) -> Option<HashMap<String, String>> {
    use opentelemetry::trace::TraceContextExt as _;
    if !EXPORTING.load(Ordering::Relaxed) {
        return None;
    }
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.contains_key("traceparent").then_some(carrier)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_rpc_in_the_opt_in_drops_the_older_rpc_attributes() {
        assert!(stable_rpc_opt_in("rpc"));
        assert!(stable_rpc_opt_in("http, rpc"));
        assert!(!stable_rpc_opt_in("rpc/dup"));
        assert!(!stable_rpc_opt_in("rpc,rpc/dup"));
        assert!(!stable_rpc_opt_in("http,messaging"));
        assert!(!stable_rpc_opt_in(""));
    }

    #[test]
    fn the_otel_environment_chooses_the_endpoint() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(export_endpoint(None, env(&[])), None);
        assert_eq!(
            export_endpoint(
                None,
                env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317")])
            ),
            Some("http://c:4317".into())
        );
        assert_eq!(
            export_endpoint(
                Some("http://m:4317"),
                env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317")])
            ),
            Some("http://m:4317".into())
        );
        assert_eq!(
            export_endpoint(
                Some("http://m:4317"),
                env(&[("OTEL_TRACES_EXPORTER", "none")])
            ),
            None
        );
        assert_eq!(
            export_endpoint(
                None,
                env(&[
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
                    ("OTEL_SDK_DISABLED", "true")
                ])
            ),
            None
        );
    }

    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn human_logs_escape_control_characters() {
        let buf = Buf::default();
        let out = buf.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || buf.clone())
            .with_ansi(false)
            .fmt_fields(super::human_fields())
            .finish();
        tracing::subscriber::with_default(sub, || {
            let topic = "orders\nINFO forged line\u{1b}[31m";
            tracing::info!(%topic, operator = "ops\r\n", "requeued {}", "x\ny");
        });
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(!text.contains('\u{1b}'), "{text}");
        assert!(
            text.contains("orders\\nINFO forged line\\u{1b}[31m"),
            "{text}"
        );
        assert!(text.contains("requeued x\\ny"), "{text}");
    }
}
