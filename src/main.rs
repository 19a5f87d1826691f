//! The `mailroom` binary: parse configuration, start logging, run until SIGTERM/SIGINT.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use mailroom::app::{App, open_store};
use mailroom::config::{Config, Settings};

/// Transactional outbox/inbox service: durable gRPC intake, ordered Kafka relay.
///
/// Every setting can be given as a flag, as a MAILROOM_* environment variable or in the
/// TOML file named by --config (flags win over the environment, which wins over the file).
#[derive(Parser)]
#[command(name = "mailroom", version)]
struct Cli {
    #[command(flatten)]
    settings: Settings,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the service (the default).
    Serve,
    /// Apply database migrations and exit.
    Migrate,
    /// Operate a running server: backlog, failed events, requeue, cancel, stats, audit.
    Admin(Box<mailroom::cli::AdminArgs>),
}

/// Exit code for a configuration error (EX_USAGE).
const EXIT_CONFIG: u8 = 64;

/// Cancels the token on SIGTERM or SIGINT.
fn shutdown_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        #[cfg(not(unix))]
        let _ = ctrl_c.await;
        tracing::info!("shutdown signal received");
        t.cancel();
    });
    token
}

// `mailroom admin …` is parsed on its own, with the operator client's options only, so
// that `mailroom admin --help` does not list the server's settings.
/// Operate a running mailroom: backlog, failed events, requeue, cancel, stats, audit.
#[derive(Parser)]
#[command(name = "mailroom admin", version)]
struct AdminCli {
    #[command(flatten)]
    args: mailroom::cli::AdminArgs,
}

/// `mailroom migrate`: applies this binary's migrations and logs the verdict on the
/// schema (a database a newer release migrated is left as it is).
async fn migrate(config: &Config) -> anyhow::Result<()> {
    let store = open_store(config).await?;
    tracing::info!("migrations applied");
    mailroom::schema::SchemaGate::new(store).read().await?;
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cli = if argv.get(1).is_some_and(|a| a == "admin") {
        let rest = argv[2..].iter().cloned();
        let admin = AdminCli::parse_from(std::iter::once("mailroom admin".into()).chain(rest));
        Err(admin.args)
    } else {
        Ok(Cli::parse_from(argv))
    };
    let cli = match cli {
        Ok(Cli {
            command: Some(Command::Admin(args)),
            ..
        }) => Err(*args),
        other => other,
    };
    let cli = match cli {
        Ok(cli) => cli,
        // A client of a running server: the server's own settings do not apply.
        Err(args) => {
            return match mailroom::cli::run(args).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("mailroom admin: {}", mailroom::cli::error_text(&e));
                    ExitCode::from(mailroom::cli::exit_code(&e))
                }
            };
        }
    };
    let config = match Config::load(cli.settings) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mailroom: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let telemetry =
        match mailroom::telemetry::init(config.log_format, config.otlp_endpoint.as_deref()) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("mailroom: cannot start telemetry: {e:#}");
                return ExitCode::FAILURE;
            }
        };
    let result = match cli.command.unwrap_or(Command::Serve) {
        Command::Serve => match App::start(config, shutdown_signal()).await {
            Ok(app) => app.wait().await,
            Err(e) => Err(e),
        },
        Command::Admin(_) => unreachable!("handled before the configuration is loaded"),
        Command::Migrate => {
            let config = Config {
                migrate: true,
                ..config
            };
            migrate(&config).await
        }
    };
    telemetry.shutdown();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("mailroom: {e:#}");
            ExitCode::FAILURE
        }
    }
}
