//! Logs, and optional OTLP trace export. Logs go to stderr (human or JSON). With an OTLP
//! endpoint configured, spans are also exported over OTLP/gRPC; spans that start from a
//! W3C `traceparent` (an `Enqueue` call that carried one, an inbox handler call for an
//! event that has one) join the producer's trace. Off by default.

use std::collections::HashMap;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::LogFormat;

/// Keeps the exporter alive; `shutdown` flushes the spans still buffered.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
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
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = match format {
        LogFormat::Human => fmt.boxed(),
        LogFormat::Json => fmt.json().boxed(),
    };
    let provider = match otlp_endpoint {
        None => None,
        Some(endpoint) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .build()?;
            let processor =
                opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
                    exporter,
                    opentelemetry_sdk::runtime::Tokio,
                )
                .build();
            Some(
                SdkTracerProvider::builder()
                    .with_span_processor(processor)
                    .with_resource(
                        opentelemetry_sdk::Resource::builder()
                            .with_service_name("mailroom")
                            .build(),
                    )
                    .build(),
            )
        }
    };
    let otel = provider
        .as_ref()
        .map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("mailroom")));
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init()?;
    Ok(Telemetry { provider })
}

/// Makes `span` a child of the W3C `traceparent` given, when it is well formed (a no-op
/// without an OTLP exporter).
pub fn join_trace(span: &tracing::Span, traceparent: Option<&str>) {
    if let Some(tp) = traceparent {
        let carrier = HashMap::from([("traceparent".to_string(), tp.to_string())]);
        let cx = TraceContextPropagator::new().extract(&carrier);
        let _ = span.set_parent(cx);
    }
}
