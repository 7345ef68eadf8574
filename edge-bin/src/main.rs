//! The `waygate` binary: a thin shell over the edge library (see `lib.rs`).

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
    /// Print the client protocol version and the close-code table.
    Protocol,
}

fn main() {
    let cli = Cli::parse();
    match cli.command {
        Command::Protocol => {
            println!(
                "waygate client protocol v{}",
                waygate_transport::protocol::PROTOCOL_VERSION
            );
            for code in waygate_transport::protocol::CloseCode::KNOWN {
                println!("{:>5}  {}", code.to_u16(), code.as_str());
            }
        }
    }
}
