//! The binary's log output (O2): text or JSON lines (`--log-format`), filtered by
//! `RUST_LOG`, with per-session sampling: the session layer marks each session's span
//! `sampled = true/false` (`session.trace_sample_rate`), and [`SessionSampling`] drops the
//! debug and trace events of unsampled sessions. Info, warnings and errors — the error paths
//! — are always logged, whatever the sampling. Libraries only emit spans and events; this is
//! the one place a subscriber is installed.

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Filter, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::Layer as _;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (spans and their fields included), for log pipelines.
    Json,
}

/// Marks a span (and so its events) as not sampled.
struct Unsampled;

/// The per-layer filter of per-session sampling (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct SessionSampling;

struct SampledField(Option<bool>);

impl Visit for SampledField {
    fn record_bool(&mut self, field: &Field, value: bool) {
        if field.name() == "sampled" {
            self.0 = Some(value);
        }
    }

    fn record_debug(&mut self, _field: &Field, _value: &dyn std::fmt::Debug) {}
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Filter<S> for SessionSampling {
    fn enabled(&self, _meta: &Metadata<'_>, _cx: &Context<'_, S>) -> bool {
        true
    }

    fn event_enabled(&self, event: &Event<'_>, cx: &Context<'_, S>) -> bool {
        // Levels order by verbosity: INFO, WARN and ERROR are "at most INFO".
        if *event.metadata().level() <= Level::INFO {
            return true;
        }
        cx.event_scope(event).is_none_or(|scope| {
            scope
                .from_root()
                .all(|span| span.extensions().get::<Unsampled>().is_none())
        })
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, cx: Context<'_, S>) {
        let mut sampled = SampledField(None);
        attrs.record(&mut sampled);
        if sampled.0 == Some(false) {
            if let Some(span) = cx.span(id) {
                span.extensions_mut().insert(Unsampled);
            }
        }
    }
}

/// Installs the process's subscriber: `RUST_LOG` (else `default`) filtering, `format`, per
/// session sampling, written to `writer`.
pub fn init<W>(default: &str, format: LogFormat, writer: W)
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let base = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_writer(writer);
    let output = match format {
        LogFormat::Text => base.with_filter(SessionSampling).boxed(),
        LogFormat::Json => base.json().with_filter(SessionSampling).boxed(),
    };
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(output)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn subscriber(buf: Buffer, format: LogFormat) -> impl Subscriber + Send + Sync {
        let base = tracing_subscriber::fmt::layer()
            .with_target(false)
            .with_ansi(false)
            .with_writer(move || buf.clone());
        let output = match format {
            LogFormat::Text => base.with_filter(SessionSampling).boxed(),
            LogFormat::Json => base.json().with_filter(SessionSampling).boxed(),
        };
        tracing_subscriber::registry()
            .with(tracing_subscriber::EnvFilter::new("debug"))
            .with(output)
    }

    fn text(buf: &Buffer) -> String {
        String::from_utf8(buf.0.lock().unwrap_or_else(|e| e.into_inner()).clone())
            .unwrap_or_default()
    }

    #[test]
    fn unsampled_sessions_lose_their_debug_events_never_their_errors() {
        let buf = Buffer::default();
        tracing::subscriber::with_default(subscriber(buf.clone(), LogFormat::Text), || {
            let quiet = tracing::info_span!("session", sampled = false, player = "q");
            quiet.in_scope(|| {
                tracing::debug!("quiet-debug");
                tracing::warn!("quiet-warning");
            });
            let loud = tracing::info_span!("session", sampled = true, player = "l");
            loud.in_scope(|| tracing::debug!("loud-debug"));
            tracing::debug!("outside-debug");
        });
        let out = text(&buf);
        assert!(!out.contains("quiet-debug"), "{out}");
        assert!(out.contains("quiet-warning"), "{out}");
        assert!(out.contains("loud-debug"), "{out}");
        assert!(out.contains("outside-debug"), "{out}");
        assert!(
            out.contains("player=\"q\""),
            "spans carry their fields: {out}"
        );
    }

    #[test]
    fn json_lines_carry_the_session_fields() {
        let buf = Buffer::default();
        tracing::subscriber::with_default(subscriber(buf.clone(), LogFormat::Json), || {
            let span = tracing::info_span!(
                "session",
                sampled = true,
                session = "ab12",
                player = "p",
                transport = "kcp"
            );
            span.in_scope(|| tracing::info!(code = 103, "link down, session lingers"));
        });
        let out = text(&buf);
        let line: serde_json::Value =
            serde_json::from_str(out.lines().next().unwrap_or("")).unwrap();
        assert_eq!(line["fields"]["message"], "link down, session lingers");
        assert_eq!(line["span"]["player"], "p");
        assert_eq!(line["span"]["transport"], "kcp");
        assert_eq!(line["span"]["session"], "ab12");
    }
}
