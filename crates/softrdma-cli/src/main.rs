//! The `softrdma` command.

use clap::{Parser, Subcommand};

/// RDMA in software over TCP, speaking iWARP.
#[derive(Debug, Parser)]
#[command(name = "softrdma", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Decode the iWARP traffic of a pcap capture (being written).
    Dissect {
        /// The capture file.
        file: std::path::PathBuf,
    },
}

fn main() {
    let cli = Cli::parse();
    match cli.command {
        Command::Dissect { file } => {
            eprintln!("softrdma dissect {}: not yet implemented", file.display());
            std::process::exit(2);
        }
    }
}
