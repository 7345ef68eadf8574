//! The `waygate` binary: a thin shell over the edge library (see `lib.rs`).

use std::net::SocketAddr;
use std::sync::Arc;

use clap::{Parser, Subcommand};

/// waygate, an edge gateway for online games.
#[derive(Debug, Parser)]
#[command(name = "waygate", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the demo game backend alone (player and room services).
    Backend {
        /// Address to listen on for edge links.
        #[arg(long, default_value = "127.0.0.1:7601")]
        addr: SocketAddr,
        /// Instance id (must match the route table).
        #[arg(long, default_value = "b1")]
        id: String,
    },
    /// Print the client protocol version and the close-code table.
    Protocol,
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .try_init();
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_tracing();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("waygate: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result: Result<(), String> = runtime.block_on(async move {
        match cli.command {
            Command::Backend { addr, id } => {
                let service = Arc::new(waygate::backend::demo::DemoService::new());
                let backend = waygate::backend::Backend::bind(
                    addr,
                    waygate::backend::BackendConfig::new(id.clone()),
                    service,
                )
                .await
                .map_err(|e| format!("backend {id} on {addr}: {e}"))?;
                println!("backend {id} listening on {}", backend.local_addr());
                tokio::signal::ctrl_c().await.map_err(|e| e.to_string())?;
                Ok(())
            }
            Command::Protocol => {
                println!(
                    "waygate client protocol v{}",
                    waygate_transport::protocol::PROTOCOL_VERSION
                );
                for code in waygate_transport::protocol::CloseCode::KNOWN {
                    println!("{:>5}  {}", code.to_u16(), code.as_str());
                }
                Ok(())
            }
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("waygate: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
